"""Turns scheduled rows into model inputs and runs one forward step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.sequence import Sequence
from services.engine.step_context import RowInput, StepContext

PAD_TOKEN_ID = 0  # any valid id: padded tokens write to the scratch block and are never attended


class ScheduledRow(NamedTuple):
    """A sequence and how many of its pending tokens this step computes."""

    seq: Sequence
    num_new: int


class StepOutput(NamedTuple):
    """Per-row results of a step: the logits and final normed hidden state at each row's last token."""

    logits: torch.Tensor  # [B, V] fp32
    hidden_states: torch.Tensor  # [B, E] model dtype; the in-loop safety gate reads this
    hot_mass: torch.Tensor | None = None  # [1] share of attention mass on hot tokens (sampled steps)


class ModelRunner:
    """Owns the model and its KV cache on one device."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def run(self, rows: Seq[ScheduledRow], probe_layer: int | None = None) -> StepOutput:
        """Compute each row's next `num_new` pending tokens (right-padded to the longest row)."""
        width = max(r.num_new for r in rows)
        inputs = [self._row_tokens(r, width) for r in rows]
        input_ids = self._to_device(inputs)  # [B, S]
        row_inputs = [RowInput(r.seq.block_table, r.seq.num_computed_tokens, r.num_new) for r in rows]
        ctx = StepContext.build(row_inputs, self.kv_cache.block_size, self.device, probe_layer)
        hidden = self.model(input_ids, self.kv_cache, ctx)  # [B, S, E]
        if width == 1:  # decode
            hidden_last = hidden[:, 0]
        else:  # prefill
            last = self._to_device([r.num_new - 1 for r in rows])  # [B]
            hidden_last = hidden[torch.arange(len(rows), device=self.device), last]  # [B, E]
        hot_mass = ctx.probe.hot_mass if ctx.probe is not None else None
        return StepOutput(self.model.compute_logits(hidden_last), hidden_last, hot_mass)

    @staticmethod
    def _row_tokens(row: ScheduledRow, width: int) -> list[int]:
        start = row.seq.num_computed_tokens
        if row.num_new == 1 and start == row.seq.num_tokens - 1:  # decode: no list copy
            return [row.seq.last_token_id] + [PAD_TOKEN_ID] * (width - 1)
        tokens = row.seq.token_ids[start : start + row.num_new]
        return tokens + [PAD_TOKEN_ID] * (width - len(tokens))

    def _to_device(self, values: list[list[int]] | list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
