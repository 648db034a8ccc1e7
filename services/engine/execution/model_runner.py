"""Turns scheduled rows into model inputs and runs one forward step over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch

from services.engine.execution.step_context import RowInput, StepContext
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import KVCache, WarmCopy
from services.engine.model.llama import LlamaModel
from services.engine.scheduling.sequence import Sequence

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


class StepPlan(NamedTuple):
    """Everything a rank needs to run one step: built on rank 0, sent to the others under TP."""

    input_ids: list[list[int]]  # [B][S] right-padded
    rows: list[RowInput]
    probe_layer: int | None
    warm_copies: list[WarmCopy]  # demotions rank 0 made since the last step (TP only)

    def portable(self) -> StepPlan:
        """A copy whose block tables hold only what attention reads (cheap to pickle)."""
        rows = [RowInput(_attention_view(r.table), r.start, r.num_new) for r in self.rows]
        return self._replace(rows=rows, probe_layer=None)  # only rank 0 reads the probe


class StepFollower(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them."""

    def send(self, plan: StepPlan) -> None:
        """Hand a step to every other rank; they run it in lockstep with rank 0."""

    def close(self) -> None:
        """Stop the other ranks."""

    def lost_rank(self) -> str | None:
        """Why the other ranks cannot run a step, or None while they can."""


class ModelRunner:
    """Owns the model and its KV cache on one device; on rank 0 it also drives the other TP ranks."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        device: torch.device,
        followers: StepFollower | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.followers = followers
        if followers is not None:
            kv_cache.warm_copy_log = []

    @torch.inference_mode()
    def run(self, rows: Seq[ScheduledRow], probe_layer: int | None = None) -> StepOutput:
        """Compute each row's next `num_new` pending tokens (right-padded to the longest row)."""
        if self.model.tp.is_parallel and self.followers is None:
            raise RuntimeError("the other tensor-parallel ranks are stopped; load the engine again")
        width = max(r.num_new for r in rows)
        plan = StepPlan(
            input_ids=[self._row_tokens(r, width) for r in rows],
            rows=[RowInput(r.seq.block_table, r.seq.num_computed_tokens, r.num_new) for r in rows],
            probe_layer=probe_layer,
            warm_copies=self.kv_cache.take_warm_copies(),
        )
        if self.followers is not None:
            self.followers.send(plan.portable())
        hidden_last, ctx = self._forward(plan)
        hot_mass = ctx.probe.hot_mass if ctx.probe is not None else None
        return StepOutput(self.model.compute_logits(hidden_last), hidden_last, hot_mass)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Run rank 0's step on this rank: replay its demotions, then the forward (its all-reduces)."""
        for copy in plan.warm_copies:
            self.kv_cache.copy_to_warm(copy)
        self._forward(plan)

    def lost_rank(self) -> str | None:
        """Why this runner's tensor-parallel group cannot run a step, or None (always None at TP=1)."""
        return self.followers.lost_rank() if self.followers is not None else None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, StepContext]:
        """The final normed hidden state at each row's last new token, `[B, E]`, and the step's context."""
        input_ids = self._to_device(plan.input_ids)  # [B, S]
        ctx = StepContext.build(plan.rows, self.kv_cache.block_size, self.device, plan.probe_layer)
        hidden = self.model(input_ids, self.kv_cache, ctx)  # [B, S, E]
        if input_ids.shape[1] == 1:  # decode
            return hidden[:, 0], ctx
        last = self._to_device([r.num_new - 1 for r in plan.rows])  # prefill: [B]
        return hidden[torch.arange(len(plan.rows), device=self.device), last], ctx

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


def _attention_view(table: BlockTable) -> BlockTable:
    """The parts of a block table that `StepContext.build` reads."""
    return BlockTable(table.tiers, list(table.hot_block_ids), dict(table.warm_groups))
