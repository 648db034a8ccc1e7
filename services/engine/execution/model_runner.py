"""Turns scheduled rows into model inputs and runs one forward step over the paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np
import torch

from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import (
    AttentionMetadata,
    HostMetadata,
    MetadataPart,
    QueryTap,
    RowInput,
)
from services.engine.attention.probe import AttentionProbe, probe_layer
from services.engine.attention.reference import ReferenceBackend
from services.engine.execution.cuda_graphs import DecodeGraphs
from services.engine.kv.block_table import BlockTable, WarmGroups
from services.engine.kv.cache import KVCache, WarmCopy, queued_copies
from services.engine.kv.cold_moves import ColdMoves, ColdStore, ColdSummaries, ScoreRow
from services.engine.kv.cold_tier import BlockToStore, ColdTier, Job, Operation
from services.engine.model.llama import LlamaModel
from services.engine.scheduling.sequence import Sequence

logger = logging.getLogger(__name__)

# "triton-paged": the fused Triton backend with every prefill step on its paged kernel (no dense
# prefill through cuDNN and FlashAttention; see attention/dense_prefill.py).
ATTENTION_BACKENDS = ("auto", "reference", "triton", "triton-paged")


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner executes steps; every tensor-parallel rank gets the same."""

    attention: str = "auto"  # one of ATTENTION_BACKENDS; "auto": Triton on CUDA, reference elsewhere
    cuda_graphs: bool = True  # capture decode steps (CUDA with a graph-capable backend only)
    max_decode_rows: int = 1  # the largest decode batch: sizes the graphs and flash-decoding workspace
    max_seq_len: int = 0  # longest sequence (0: the model's rotary table): sizes the graphs' block tables
    chunk_tokens: int = 0  # the prompt chunk (max prefill tokens): the dense prefill path's plan shape

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.attention!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
            )


class ScheduledRow(NamedTuple):
    """A sequence and how many of its pending tokens this step computes."""

    seq: Sequence
    num_new: int


class StepOutput(NamedTuple):
    """Per-row results of a step: the logits and final normed hidden state at each row's last token."""

    logits: torch.Tensor  # [B, V] fp32
    hidden_states: torch.Tensor  # [B, E] model dtype; the in-loop safety gate reads this
    hot_mass: torch.Tensor | None = None  # [1] share of attention mass on hot tokens (sampled steps)
    window_scores: list[tuple[ScoreRow, torch.Tensor]] | None = None  # [N] per scored row (cold tier)
    probe_row: int = 0  # the row `hot_mass` measured (modulo the batch size)


class StepPlan(NamedTuple):
    """Everything a rank needs to run one step: built on rank 0, sent to the others under TP.

    Tier moves travel here too: the demotions the scheduler decided since the last step, which
    every rank carries out on its own share of the cache before the forward.
    """

    input_ids: list[int]  # [T] the rows' new tokens, packed
    rows: list[RowInput]
    probe_layer: int | None
    warm_copies: list[WarmCopy]
    cold_moves: ColdMoves = ColdMoves()
    score_rows: tuple[ScoreRow, ...] = ()

    def portable(self) -> StepPlan:
        """A copy whose block tables hold only what attention reads (cheap to pickle)."""
        rows = [RowInput(_attention_view(r.table), r.start, r.num_new) for r in self.rows]
        return self._replace(rows=rows, probe_layer=None)  # only rank 0 reads the probe


class PreparedStep(NamedTuple):
    """A step built on the host ahead of its launch: the plan (input ids not yet known) and metadata.

    The engine prepares step N+1 while step N runs on the device, so that only the input ids (step
    N's sampled tokens) are left between N's sync and N+1's launch.
    """

    rows: tuple[ScheduledRow, ...]
    plan: StepPlan  # input_ids empty until launch
    host: HostMetadata
    num_allocated: int  # the hot pool's `num_allocated_total` when the metadata was built


class StepFollower(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them."""

    def send(self, plan: StepPlan) -> None:
        """Hand a step to every other rank; they run it in lockstep with rank 0."""

    def close(self) -> None:
        """Stop the other ranks."""

    def capture_graphs(self) -> None:
        """Have every other rank capture its decode graphs, alongside rank 0."""

    def lost_rank(self) -> str | None:
        """Why the other ranks cannot run a step, or None while they can."""


class ModelRunner:
    """Owns the model, its KV cache and attention backend on one device; on rank 0 it also drives the
    other TP ranks. Every rank runs the same backend and captures the same graphs."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        device: torch.device,
        followers: StepFollower | None = None,
        options: RunnerOptions = RunnerOptions(),
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.followers = followers
        self.attention = make_attention_backend(
            options.attention, kv_cache, model, options.max_decode_rows, options.chunk_tokens
        )
        # on CUDA the small ops run as fused Triton kernels too, unless the reference path was asked for
        model.use_fused_ops(device.type == "cuda" and options.attention != "reference")
        self.graphs: DecodeGraphs | None = None
        self._num_probes = 0
        self.num_mixed_steps = 0  # steps whose decode rows and prompt chunks attended apart
        self.cold_tier: ColdTier | None = None
        self.cold_summaries: ColdSummaries | None = None
        if options.cuda_graphs and device.type == "cuda" and self.attention.supports_graphs:
            self.graphs = DecodeGraphs(
                model, kv_cache, self.attention, options.max_decode_rows,
                options.max_seq_len or model.rotary.max_positions, compute_logits=model.tp.rank == 0,
                probe_layer=probe_layer(model.rank_config.num_layers) if kv_cache.warm is not None else None,
            )  # fmt: skip

    def capture_graphs(self) -> None:
        """Capture the decode graphs; under TP every rank captures at once (the graphs hold collectives)."""
        if self.followers is not None:
            self.followers.capture_graphs()
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture()

    def attach_cold_tier(self, tier: ColdTier) -> None:
        """Carry out cold-tier moves through `tier`; summary keys are kept at the tier's scoring layer
        (the middle layer unless `score_layer` says otherwise)."""
        if self.model.tp.is_parallel:
            raise ValueError("the cold tier runs at tensor parallelism 1 only; unset the kvstore target")
        config = self.model.rank_config
        layer = tier.config.score_layer  # checked against the model by LLMEngine.attach_cold_tier
        self.cold_tier = tier
        self.cold_summaries = ColdSummaries(
            config.num_layers // 2 if layer < 0 else layer, config.num_kv_heads, config.head_dim, self.device
        )

    def prepare(
        self, rows: Seq[ScheduledRow], probe_layer: int | None = None, score_rows: Seq[ScoreRow] = ()
    ) -> PreparedStep:
        """Build a step on the host: take the tier moves decided so far, and the rows' metadata.

        The block tables are read now; a row whose sequence ends before `launch` still computes (into
        blocks it has released, which no later step can reuse before this one has run, in stream
        order), and its token is dropped by the caller.
        """
        plan = StepPlan(
            input_ids=[],
            rows=[RowInput(r.seq.block_table, r.seq.num_computed_tokens, r.num_new) for r in rows],
            probe_layer=probe_layer,
            warm_copies=self.kv_cache.take_warm_copies(),
            cold_moves=self.kv_cache.take_cold_moves(),
            score_rows=tuple(score_rows),
        )
        host = HostMetadata.build(plan.rows, self.kv_cache.block_size, self._blocks_per_group())
        if self.followers is not None:  # the other ranks must see the tables as they are now
            plan = plan.portable()._replace(probe_layer=probe_layer)
        return PreparedStep(tuple(rows), plan, host, self.kv_cache.hot.pool.num_allocated_total)

    @torch.inference_mode()
    def launch(
        self, step: PreparedStep, tables_changed: bool = False, input_ids: torch.Tensor | None = None
    ) -> StepOutput:
        """Run a prepared step: its input ids are read now (the last step's tokens are committed), or
        are `input_ids` `[T]` on the device (an overlapped step: the last step's sampled ids, not yet
        synced; TP=1 only, since the other ranks take their ids from the plan).

        Tier moves decided since `prepare` join this step's (a demotion never waits a step more).
        The metadata is built again when hot blocks were handed out since `prepare` (cold-tier
        window loads), since a block a dead row still names may now be another row's, or when the
        caller says tables changed.
        """
        if self.model.tp.is_parallel and self.followers is None:
            raise RuntimeError("the other tensor-parallel ranks are stopped; load the engine again")
        if input_ids is None:
            plan = step.plan._replace(input_ids=[token for r in step.rows for token in _row_tokens(r)])
        elif self.followers is not None:
            raise ValueError("an overlapped step (device input ids) runs at tensor parallelism 1 only")
        else:
            plan = step.plan
        late_copies, late_moves = self.kv_cache.take_warm_copies(), self.kv_cache.take_cold_moves()
        if late_copies or late_moves:
            plan = plan._replace(
                warm_copies=plan.warm_copies + late_copies,
                cold_moves=ColdMoves(
                    plan.cold_moves.stores + late_moves.stores, plan.cold_moves.loads + late_moves.loads
                ),
            )
        host = step.host
        if tables_changed or step.num_allocated != self.kv_cache.hot.pool.num_allocated_total:
            host = HostMetadata.build(plan.rows, self.kv_cache.block_size, self._blocks_per_group())
        if self.followers is not None:
            self.followers.send(plan.portable())
        return self._forward(plan, host, input_ids)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Run rank 0's step on this rank (its demotions, then the forward with its all-reduces)."""
        self._forward(plan, HostMetadata.build(plan.rows, self.kv_cache.block_size, self._blocks_per_group()))

    def lost_rank(self) -> str | None:
        """Why this runner's tensor-parallel group cannot run a step, or None (always None at TP=1)."""
        return self.followers.lost_rank() if self.followers is not None else None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    def _forward(
        self, plan: StepPlan, host: HostMetadata, device_ids: torch.Tensor | None = None
    ) -> StepOutput:
        """Carry out the plan's tier moves, then the forward; outputs at each row's last new token."""
        self._apply_moves(plan.cold_moves, plan.warm_copies)
        graphs = self.graphs
        if (
            graphs is not None
            and not plan.score_rows
            and plan.probe_layer in (None, graphs.probe_layer)
            and graphs.can_replay(host)
        ):  # decode
            hidden, logits = graphs.replay(plan.input_ids if device_ids is None else device_ids, host)
            output = StepOutput(logits if logits is not None else hidden, hidden)
            if plan.probe_layer is None:
                return output
            assert graphs.probe_queries is not None
            sampled = self._next_probe(plan.probe_layer)  # over the replay's queries, in stream order
            queries = graphs.probe_queries[: host.num_rows]
            sampled.record(self.kv_cache, queries, AttentionMetadata.to_device(host, self.device))
            return output._replace(hot_mass=sampled.hot_mass, probe_row=sampled.row)
        probe = None if plan.probe_layer is None else self._next_probe(plan.probe_layer)
        tap = self._query_tap(host.num_rows) if plan.score_rows and host.is_decode else None
        split = host.num_leading_decode_rows()
        if split:  # a mixed step: its decode rows and its prompt chunks attend apart
            self.num_mixed_steps += 1
            parts = tuple(
                MetadataPart(
                    int(host.query_start_loc[first]),
                    int(host.query_start_loc[end]),
                    self._metadata(host.row_range(first, end)),
                )
                for first, end in ((0, split), (split, host.num_rows))
            )
            metadata = replace(AttentionMetadata.to_device(host, self.device), parts=parts)
        else:
            metadata = self._metadata(host, probe, tap)
        if device_ids is None:
            input_ids = to_device(np.asarray(plan.input_ids, dtype=np.int64), self.device)  # [T]
        else:
            input_ids = device_ids
        hidden = self.model(input_ids, self.kv_cache, self.attention, metadata)  # [T, E]
        if not host.is_decode:  # prefill: each row's last new token
            hidden = hidden[to_device(host.last_token_index(), self.device)]
        logits = self.model.compute_logits(hidden) if self.model.tp.rank == 0 else hidden
        window = None if tap is None else self._score_cold(plan.score_rows, tap)
        hot_mass, probe_row = (None, 0) if probe is None else (probe.hot_mass, probe.row)
        return StepOutput(logits, hidden, hot_mass, window, probe_row)

    def _metadata(
        self, host: HostMetadata, probe: AttentionProbe | None = None, tap: QueryTap | None = None
    ) -> AttentionMetadata:
        """`host` on the device, with the split, warm pages or dense plan this backend takes for it."""
        if host.is_decode:
            segments = self.attention.num_segments(host.num_rows, host.max_seq_len)
        else:
            segments = self.attention.prefill_segments(
                host.num_tokens, host.num_rows, host.max_query_len, host.max_seq_len
            )
        return AttentionMetadata.to_device(
            host, self.device, segments, probe, tap, self.attention.prefix_page_blocks(host.max_query_len),
            dense_prefill=not host.is_decode and self.attention.wants_dense_prefill(host.max_query_len),
        )  # fmt: skip

    def carry_out_moves(self) -> None:
        """Carry out the tier moves decided so far without a step, then start the prefix loads that
        wait for them (an engine with no step to run; TP=1, where the cold tier runs)."""
        if self.cold_tier is not None and self.cold_tier.has_fenced:
            self._apply_moves(self.kv_cache.take_cold_moves(), self.kv_cache.take_warm_copies())

    def _apply_moves(self, cold_moves: ColdMoves, warm_copies: list[WarmCopy]) -> None:
        """Queue the tier moves, then start the prefix loads held for them: their writes go after
        every device operation queued so far, which includes all work on the blocks they were given.

        Order matters: cold stores read their warm groups before these warm copies may reuse them,
        and cold loads write their hot blocks after the warm copies have read the ones they free.
        """
        self._store_cold(cold_moves.stores)
        self.kv_cache.copy_to_warm(warm_copies)
        self.kv_cache.write_loaded(cold_moves.loads)
        if self.cold_tier is not None and self.cold_tier.has_fenced:
            self.cold_tier.release_fenced(queued_copies(self.kv_cache.hot.keys.device))

    def _next_probe(self, layer: int) -> AttentionProbe:
        """A probe of `layer`; each one measures the next row of the batch (rotating through it)."""
        self._num_probes += 1
        return AttentionProbe.build(layer, self.device, row=self._num_probes)

    def _query_tap(self, num_rows: int) -> QueryTap:
        assert self.cold_summaries is not None
        config = self.model.rank_config
        return QueryTap.build(
            self.cold_summaries.layer, num_rows, config.num_heads, config.head_dim, self.device
        )

    def _score_cold(self, rows: Seq[ScoreRow], tap: QueryTap) -> list[tuple[ScoreRow, torch.Tensor]]:
        """Each scored row's cold blocks, best first `[k]` (on the device; read after the step's sync)."""
        summaries = self.cold_summaries
        assert summaries is not None
        scored = []
        for row in rows:
            if row.owner in summaries and row.num_slots:
                scores = summaries.scores(row.owner, row.num_slots, tap.queries[row.row])  # [N]
                scored.append((row, scores.topk(min(row.num_blocks, row.num_slots)).indices))
        return scored

    def _store_cold(self, stores: Seq[ColdStore]) -> None:
        """Copy each block to the host (and a demoted block's summary key) and queue its puts, one job
        per request and operation."""
        if not stores:
            return
        assert self.cold_tier is not None and self.cold_summaries is not None
        jobs: dict[tuple[str, Operation], list[ColdStore]] = {}
        for store in stores:
            jobs.setdefault((store.seq.request_id, store.operation), []).append(store)
        blocks = {id(store): self._copy_for_store(store) for store in stores}
        ready = _device_copies_done(self.device)
        for group in jobs.values():
            seq = group[0].seq
            job = Job(
                group[0].operation, seq, seq.cache_salt, seq.trace_metadata,
                blocks=tuple(blocks[id(store)] for store in group), ready=ready,
            )  # fmt: skip
            self.cold_tier.submit(job)

    def _copy_for_store(self, store: ColdStore) -> BlockToStore:
        """The block a store names, on its way to the host; a demotion also records its summary key."""
        assert self.cold_summaries is not None
        keys, values = self._read_for_store(store)
        if store.summary_slot is not None:
            self.cold_summaries.add(store.seq.request_id, store.summary_slot, keys)
        return BlockToStore(store.block_hash, *_to_host(keys, values), store.codec)

    def _read_for_store(self, store: ColdStore) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[L, T, KVH, D]` of the block a store names."""
        if store.warm_group is not None:
            assert self.kv_cache.warm is not None
            return self.kv_cache.warm.read_group(store.warm_group)
        return self.kv_cache.hot.read_blocks(list(store.hot_block_ids))

    def _blocks_per_group(self) -> int:
        warm = self.kv_cache.warm
        return 1 if warm is None else warm.group_size // self.kv_cache.block_size


def make_attention_backend(
    name: str, kv_cache: KVCache, model: LlamaModel, max_decode_rows: int, chunk_tokens: int = 0
) -> AttentionBackend:
    """`auto`: the fused Triton path on CUDA, the reference elsewhere (Triton compiles for GPUs only).
    `chunk_tokens`: the prompt chunk, whose dense prefill plans the Triton backend builds at once."""
    device = kv_cache.hot.keys.device
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend(kv_cache)
    from services.engine.attention.triton_backend import TritonBackend  # imports Triton

    backend = TritonBackend(kv_cache, model.rank_config.num_heads, max_decode_rows, chunk_tokens)
    backend.dense_prefill = backend.dense_prefill and name != "triton-paged"
    backend.build_dense_plans()
    return backend


def _row_tokens(row: ScheduledRow) -> list[int]:
    seq = row.seq
    start = seq.num_computed_tokens
    if row.num_new == 1 and start == seq.num_tokens - 1:  # decode: no list copy
        return [seq.last_token_id]
    tokens = seq.token_ids[start : start + row.num_new]
    # a sequence that ended without a token (a fault, the safety gate) still fills its row
    return tokens + [0] * (row.num_new - len(tokens))


def _to_host(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device tensors to the host without a sync (CUDA: pinned, non-blocking; the writer waits)."""
    if keys.device.type == "cpu":
        return keys, values  # already copies: read_blocks gathers, read_group dequantizes
    return keys.to("cpu", non_blocking=True), values.to("cpu", non_blocking=True)


def _device_copies_done(device: torch.device) -> Callable[[], None] | None:
    """What the kvstore writer waits on before it reads host copies queued so far (CUDA: an event)."""
    event = queued_copies(device)
    return None if event is None else event.synchronize


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to a GPU through pinned memory, so the copy waits for nothing queued."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _attention_view(table: BlockTable) -> BlockTable:
    """The parts of a block table that `HostMetadata.build` reads."""
    return BlockTable(table.tiers, list(table.hot_block_ids), WarmGroups(table.warm_groups))
