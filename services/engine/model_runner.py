"""Turns scheduled sequences into model inputs and runs one forward step."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.sequence import Sequence
from services.engine.step_context import StepContext

PAD_TOKEN_ID = 0  # any valid id: padded positions are written to the cache but never attended


class StepOutput(NamedTuple):
    """Per-row results of a step: the next-token logits and the final normed hidden state."""

    logits: torch.Tensor  # [B, V] fp32
    hidden_states: torch.Tensor  # [B, E] model dtype; the in-loop safety gate reads this


class ModelRunner:
    """Owns the model and its KV cache on one device."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def prefill(self, seqs: Seq[Sequence]) -> StepOutput:
        """Run whole prompts, right-padded to the longest; rows sit in consecutive slots."""
        lengths = [len(s.prompt_ids) for s in seqs]
        width = max(lengths)
        rows = [s.prompt_ids + [PAD_TOKEN_ID] * (width - len(s.prompt_ids)) for s in seqs]
        input_ids = self._to_device(rows)  # [B, S]
        ctx = StepContext.build(seqs[0].slot, [list(range(width))] * len(seqs), self.device)
        hidden = self.model(input_ids, self.kv_cache, ctx)  # [B, S, E]
        last = self._to_device([n - 1 for n in lengths])  # [B]
        hidden_last = hidden[torch.arange(len(seqs), device=self.device), last]  # [B, E]
        return StepOutput(self.model.compute_logits(hidden_last), hidden_last)

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence]) -> StepOutput:
        """Feed each row's last token at its own position; rows sit in consecutive slots."""
        input_ids = self._to_device([[s.last_token_id] for s in seqs])  # [B, 1]
        ctx = StepContext.build(seqs[0].slot, [[s.num_tokens - 1] for s in seqs], self.device)
        hidden = self.model(input_ids, self.kv_cache, ctx)[:, -1]  # [B, E]
        return StepOutput(self.model.compute_logits(hidden), hidden)

    def _to_device(self, values: list[list[int]] | list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
