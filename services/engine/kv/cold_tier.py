"""The cold tier's client side: kvstore calls off the engine thread, and what they report back.

The engine thread never waits on the kvstore. It hands jobs to three daemon threads (a writer for
puts, deletes and prefetches, a prefix loader, a window loader) and, once per step, drains what
they report (`take_outcomes`). Prefix and window loads have a thread each so that one long prefix
transfer does not hold a decoding request's window behind it. Every call has a deadline; a failed
call (UNAVAILABLE, deadline, a corrupt or undecodable block) is an outcome with a reason, after
which loads are skipped for `retry_after_s` (nothing waits for a write), so a store that is down
costs one deadline, not one per request. The caller then attends over hot + warm only: a request
degrades, it never fails for the cold tier.

A prefix load holds a new request, so it has a deadline of its own (`Job.deadline_s`, set by the
caller from the request's budget): its calls get no more than what is left of it, and when it
passes first (a store that streams slowly, or a load queued behind another), a `gave_up` outcome
comes at once from a watch thread, so the request goes on to compute its prompt while the loader
finishes with the blocks it writes.

Writes hold host copies of their blocks until their put returns, so they are bounded in bytes
(`write_buffer_mb`) as well as in jobs: a write past either bound is dropped at once (DROPPED),
never queued behind a store that is slower than the engine. The cold tier is a cache, not a
promise: a dropped prompt block is computed again next time, a dropped demotion is lost as
without a cold tier.

Token pruning (`prune_tokens`). Only demoted blocks are pruned: they come back solely through the
auxiliary window, under a per-request name, while prompt blocks (prefix reuse) are stored raw under
their content hash, so no stored block serves both uses and a reused prefix stays lossless. The
attention mass a token drew is not known at demotion (the fused kernels never form per-token
weights; the engine's probe keeps one layer's hot share on sampled steps), so `key_norm_mass`
stands in for it; the codec's entropy rule then sets how many tokens go. A pruned block comes back
as its kept tokens only, packed into the first pages of its span (keys are stored after RoPE, so
where a key sits changes nothing but the causal mask, and every cold position precedes the
query); the rest of the span stays unmapped, which both attention backends already skip. So a
dropped token has no slot at all: it takes no softmax mass, on the reference and the Triton path
alike, with no mask in the step metadata. For that the kept count is rounded up to whole pages
(`keep_multiple` = the KV block size), which makes pruning coarse: with 32-token groups on 16-token
blocks a block keeps all or half its tokens, and with groups of one block it never prunes.
Shapes: L layers, BS tokens per block, G tokens per cold block (a warm group), K kept tokens, KVH, D.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import numpy as np
import torch

from services.common.kv_codec.codec import (
    KEEP_ALL,
    CodecSettings,
    decode_block,
    encode_block,
    read_layout,
)
from services.common.kv_codec.codec_format import CodecError
from services.common.kvstore_api import (
    MAX_NAME_BYTES,
    BlockHash,
    BlockIn,
    CallOptions,
    Codec,
    FetchedBlock,
    KVStoreClient,
    MissReason,
    Namespace,
)
from services.common.tenancy import UNSALTED_TENANT
from services.engine.kv.deadline_watch import DeadlineWatch, WatchId
from services.engine.kv.prefix_fetch import PrefixFetcher, PrefixLayout, PrefixSink
from services.engine.kv.write_buffer import WriteBuffer

logger = logging.getLogger(__name__)

DEFAULT_TENANT = UNSALTED_TENANT  # the kvstore namespace of requests with no cache salt
MAX_QUEUED_JOBS = 1024  # per thread; beyond it the store is treated as down for that job


class RetrievalMode(enum.Enum):
    """Whether a request's decode attends an auxiliary window of cold blocks chosen by its query."""

    OFF = "off"
    SEMANTIC = "semantic"  # Quest-style: summary keys score cold blocks; the top ones are loaded


@dataclass(frozen=True)
class ColdTierConfig:
    """Where the kvstore is and how the engine uses it; an empty `target` turns the cold tier off."""

    target: str = ""  # host:port of the kvstore service
    deadline_ms: int = 1000  # lookups, deletes and window gets; past it the engine carries on
    transfer_deadline_ms: int = 30_000  # every put, and at most a prefix load (a long prefix is many MB)
    # The longest a new request waits for its stored prefix, lookup and transfer together (the
    # caller also keeps it within half its class's queue timeout); past it the prompt is computed.
    # 8B's 32K-token prefix loads in 0.33 s on the H200 and is computed in 1.9 s
    # (bench/results/cold_tier_h200_2026-12-03_pipelined.md): a load this slow is a slow store.
    prefix_load_deadline_ms: int = 5_000
    # Host memory that writes (prompt blocks, demoted groups) may hold while they wait for the
    # store; a write past it is dropped and counted. One write is always taken when none waits
    # (so 0: one write at a time), however large: an 8B prefill chunk of 16K tokens is 2 GiB.
    write_buffer_mb: int = 2048
    retry_after_s: float = 5.0  # after a failed call, loads are skipped this long
    prefix_reuse: bool = True  # store computed prompt blocks; load a new prompt's stored prefix
    retrieval_mode: RetrievalMode = RetrievalMode.OFF  # default for requests and classes that set none
    aux_window_tokens: int = 2048  # cold tokens one sequence attends at most (whole cold blocks)
    score_every_steps: int = 16  # decode steps between two scorings of the cold blocks
    # At each scoring, the cold blocks ranked just below the window's are staged in the kvstore's RAM
    # (Prefetch), so that the next scoring's new picks come from RAM, not the disk. -1: as many as
    # the window holds; 0: none.
    prefetch_blocks: int = -1
    # The layer whose query scores the cold blocks and whose keys their summaries hold; -1: the
    # middle layer (num_layers // 2).
    score_layer: int = -1
    # Drop the tokens of demoted blocks that the key-norm proxy ranks least attended (the codec's
    # entropy rule sets how many). Off by default: it saved a third of the cold bytes and window
    # pages with a lower KL where measured, but a dropped token is gone for good, the proxy ranked
    # no better than chance on SmolLM2, and retrieval was checked once
    # (bench/results/cold_tier_pruning_2026-12-02.md).
    prune_tokens: bool = False
    # Read a prefix's records straight from the kvstore's segment files (same host, same path; the
    # kvstore must hand out locations: THERMOCLINE_KVSTORE_SERVE_LOCATIONS). Each record is checked
    # here; any that fails, and everything after it, comes by the GetBlocks stream (docs/kvstore.md).
    local_reads: bool = False
    # The host buffer prefix hits land in, kept for the engine's life so that no hit page-locks
    # memory on its path (pinned on CUDA; torch rounds a pinned allocation up to a power of two):
    # sized for a max_seq_len prompt, at most this many MiB. A longer hit gets a buffer of its own.
    # 0: a buffer per hit.
    prefix_staging_mb: int = 8192
    codec: CodecSettings = field(default_factory=CodecSettings)

    def __post_init__(self) -> None:
        deadlines = (self.deadline_ms, self.transfer_deadline_ms, self.prefix_load_deadline_ms)
        if min(deadlines) < 1:
            raise ValueError(f"kvstore deadlines must be >= 1 ms, got {deadlines}")
        if self.write_buffer_mb < 0:
            raise ValueError(f"write_buffer_mb must be >= 0, got {self.write_buffer_mb}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.score_layer < -1:
            raise ValueError(f"score_layer must be a layer index or -1 (the middle), got {self.score_layer}")
        if self.prefix_staging_mb < 0:
            raise ValueError(f"prefix_staging_mb must be >= 0, got {self.prefix_staging_mb}")
        if self.prefetch_blocks < -1:
            raise ValueError(
                f"prefetch_blocks must be >= 0, or -1 (the window's size), got {self.prefetch_blocks}"
            )
        if self.aux_window_tokens < 0 or self.score_every_steps < 1:
            raise ValueError(
                "the auxiliary window must be >= 0 tokens and scored every >= 1 steps, got "
                f"{self.aux_window_tokens} tokens every {self.score_every_steps} steps"
            )

    @property
    def enabled(self) -> bool:
        """A kvstore target is set."""
        return bool(self.target)


class Operation(enum.Enum):
    """What a cold-tier call was for (a metric label)."""

    STORE_PREFIX = "store_prefix"
    LOAD_PREFIX = "load_prefix"
    DEMOTE = "demote"
    LOAD_WINDOW = "load_window"
    PREFETCH = "prefetch"  # stage a window's runner-up blocks in the kvstore's RAM (no reply awaited)
    DELETE = "delete"


# on the loader threads (one each), and skipped while backing off; the rest (PREFETCH too: nothing
# waits for it) go on the writer thread, so that no load queues behind them
LOADS = frozenset({Operation.LOAD_PREFIX, Operation.LOAD_WINDOW})


class Degradation(enum.Enum):
    """Why a cold-tier call gave nothing (a metric label and a span event attribute)."""

    UNAVAILABLE = "unavailable"  # down, unreachable, or still backing off after a failure
    DEADLINE = "deadline"  # slower than its deadline
    CORRUPT = "corrupt"  # a block the store reported corrupt, or one that does not decode
    ERROR = "error"  # any other status
    DROPPED = "dropped"  # a write with no room in the engine's queue (the store is slower than the engine)


class WindowShape(NamedTuple):
    """What a window block must decode to (`[L, T, KVH, D]`, T a warm group's tokens): anything
    else from the store is a miss, never mapped (it could span more pages than its group has)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int


class LoadedBlock(NamedTuple):
    """One block back from the store: keys and values `[L, T, KVH, D]` on the host; for a pruned
    block, its K kept tokens in order `[L, K, KVH, D]`, K a multiple of the page size."""

    block_hash: BlockHash
    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Outcome:
    """What one job gave: the blocks stored or loaded, or why none (`degraded`)."""

    operation: Operation
    owner: object  # what the job was for (a sequence), handed back untouched
    stored: tuple[BlockHash, ...] = ()
    loaded: tuple[LoadedBlock, ...] = ()
    degraded: Degradation | None = None
    detail: str = ""
    prefix_blocks: int = 0  # LOAD_PREFIX: its leading run of blocks, written into the job's sink
    num_read_locally: int = 0  # LOAD_PREFIX: of those, blocks read from the segment files directly
    # LOAD_PREFIX: its deadline passed first, so its request goes on without it; the load's own
    # outcome (its blocks are the loader's until then) still follows
    gave_up: bool = False


class BlockToStore(NamedTuple):
    """A block's keys and values `[L, T, KVH, D]`, copied to the host, and the codec to store it in."""

    block_hash: BlockHash
    keys: torch.Tensor
    values: torch.Tensor
    codec: Codec


@dataclass(frozen=True)
class Job:
    """One unit of work for a kvstore thread."""

    operation: Operation
    owner: object
    tenant: str
    trace_metadata: tuple[tuple[str, str], ...]
    hashes: tuple[BlockHash, ...] = ()
    blocks: tuple[BlockToStore, ...] = ()
    ready: Callable[[], None] | None = None  # waits for the device copies of `blocks` (CUDA event)
    layout: PrefixLayout | None = None  # LOAD_PREFIX: how its blocks land on the host
    sink: PrefixSink | None = None  # LOAD_PREFIX: where they go (hot blocks allocated for them)
    fence: torch.cuda.Event | None = None  # LOAD_PREFIX: device work its blocks' writes go after
    deadline_s: float | None = None  # LOAD_PREFIX: when (monotonic) its request stops waiting for it
    watch_id: WatchId | None = None  # LOAD_PREFIX: its give-up, pending in the deadline watch
    window_shape: WindowShape | None = None  # LOAD_WINDOW: what each block must be (None: unchecked)

    @property
    def num_bytes(self) -> int:
        """Host memory its blocks hold (a write)."""
        return sum(b.keys.nbytes + b.values.nbytes for b in self.blocks)


class ColdTier:
    """Owns the kvstore client and its threads. `submit_*` queue work; `take_outcomes` drains.

    Every call changes only this object's queues; the engine state the outcomes refer to is
    changed by the engine thread when it takes them.
    """

    def __init__(
        self,
        config: ColdTierConfig,
        model_id: str,
        wake: Callable[[], None] = lambda: None,
        *,
        page_tokens: int,
    ) -> None:
        self.config = config
        self.model_id = model_id
        self.page_tokens = page_tokens  # the KV block size: a pruned block keeps whole pages
        self._keep_all = dataclasses.replace(config.codec, sparsity=KEEP_ALL)
        self._pruning = dataclasses.replace(
            config.codec, sparsity=dataclasses.replace(config.codec.sparsity, keep_multiple=page_tokens)
        )
        self._client = KVStoreClient(config.target, Namespace(DEFAULT_TENANT, model_id))
        self._prefixes = PrefixFetcher(self._client, config.local_reads)
        self._wake = wake
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._writes: queue.Queue[Job | None] = queue.Queue()
        self._prefix_loads: queue.Queue[Job | None] = queue.Queue()
        self._window_loads: queue.Queue[Job | None] = queue.Queue()
        self._give_ups = DeadlineWatch("kvstore-prefix-deadlines")
        self._write_buffer = WriteBuffer(config.write_buffer_mb * 2**20)
        self._down_until = 0.0
        self._fenced: list[Job] = []  # prefix loads held until the tier moves before them are queued
        self._threads = [
            threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True)
            for jobs, name in (
                (self._writes, "kvstore-writer"),
                (self._prefix_loads, "kvstore-prefix-loader"),
                (self._window_loads, "kvstore-window-loader"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def reserve_prefix_staging(self, num_blocks: int, layout: PrefixLayout) -> None:
        """Keep the host buffer that prefix hits of up to `num_blocks` blocks land in (before the
        first load is submitted: the loader thread uses it afterwards)."""
        self._prefixes.reserve(num_blocks, layout)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """What a thread calls after it reports an outcome (the engine wakes its loop)."""
        self._wake = wake

    @property
    def is_backing_off(self) -> bool:
        """A call failed less than `retry_after_s` ago: new work would only wait for a deadline."""
        return time.monotonic() < self._down_until

    def submit(self, job: Job) -> None:
        """Queue a job: each kind of load on its loader thread, everything else on the writer.

        A store slower than the engine would grow the queue (and the host copies it holds) without
        bound: past MAX_QUEUED_JOBS a job is refused at once, a load as if the store were down, and
        a write is dropped, as it is when the write buffer has no room for its blocks.
        """
        jobs = self._queue_for(job.operation)
        if jobs.qsize() >= MAX_QUEUED_JOBS:
            self._refuse(job, "queue full")
            return
        if job.blocks and not self._write_buffer.take(job.num_bytes):
            self._refuse(job, f"write buffer full: {self._write_buffer.describe()}")
            return
        if job.operation is Operation.LOAD_PREFIX and job.deadline_s is not None:
            job = dataclasses.replace(job, watch_id=self._give_ups.at(job.deadline_s, self._giving_up(job)))
        jobs.put(job)

    def _queue_for(self, operation: Operation) -> queue.Queue[Job | None]:
        if operation is Operation.LOAD_PREFIX:
            return self._prefix_loads
        return self._window_loads if operation is Operation.LOAD_WINDOW else self._writes

    def _refuse(self, job: Job, detail: str) -> None:
        """Report a job not queued: a load as if the store were down, a write as dropped."""
        reason = Degradation.UNAVAILABLE if job.operation in LOADS else Degradation.DROPPED
        self._report(Outcome(job.operation, job.owner, degraded=reason, detail=detail))

    @property
    def num_write_bytes(self) -> int:
        """Host memory held by writes queued or in flight."""
        return self._write_buffer.num_bytes

    def _giving_up(self, job: Job) -> Callable[[], None]:
        """What the watch runs when a prefix load's deadline passes before its outcome."""
        assert job.deadline_s is not None
        budget_s = job.deadline_s - time.monotonic()
        detail = f"the stored prefix did not come within its {budget_s:.3g} s; the prompt is computed"
        return lambda: self._report(
            Outcome(job.operation, job.owner, degraded=Degradation.DEADLINE, detail=detail, gave_up=True)
        )

    def take_outcomes(self) -> list[Outcome]:
        """Every outcome reported since the last call (engine thread)."""
        found: list[Outcome] = []
        while True:
            try:
                found.append(self._outcomes.get_nowait())
            except queue.Empty:
                return found

    def submit_after_moves(self, job: Job) -> None:
        """Hold a prefix load until the engine has carried out the tier moves decided so far
        (`release_fenced`, from the model runner; engine thread only).

        Its hot blocks were free when allocated, but device work queued before may still touch them
        (a cold store or a warm copy reading a freed block at the next launch, or the step in flight
        writing the last token of a request that just ended). The loader writes them outside any
        step, so it must come after all of that: the runner records an event once the moves are
        queued, and the loader's copies wait for it.
        """
        self._fenced.append(job)

    @property
    def has_fenced(self) -> bool:
        """Prefix loads wait for the next tier moves to be queued."""
        return bool(self._fenced)

    def release_fenced(self, fence: torch.cuda.Event | None) -> None:
        """Submit the held prefix loads; their device writes go after `fence` (None: the work
        before is done already, as on the CPU)."""
        jobs, self._fenced = self._fenced, []
        for job in jobs:
            self.submit(dataclasses.replace(job, fence=fence))

    @property
    def has_outcomes(self) -> bool:
        """An outcome waits to be taken."""
        return not self._outcomes.empty()

    def wait_for_outcome(self, timeout_s: float) -> None:
        """Block until an outcome is ready to take (a caller with nothing else to do), at most `timeout_s`."""
        try:
            self._outcomes.put(self._outcomes.get(timeout=timeout_s))
        except queue.Empty:
            return

    def flush(self) -> None:
        """Wait until every job queued so far is done (benchmarks, shutdown)."""
        for jobs in (self._writes, self._prefix_loads, self._window_loads):
            jobs.join()

    def close(self) -> None:
        """Stop the threads after the queued jobs, then close the channel."""
        for jobs in (self._writes, self._prefix_loads, self._window_loads):
            jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=max(1.0, 4 * self.config.deadline_ms / 1000))
        self._give_ups.close()
        self._prefixes.close()
        self._client.close()

    # --- the threads ---------------------------------------------------------------------------

    def _serve(self, jobs: queue.Queue[Job | None]) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                self._report(self._run(job))
            except Exception as error:  # a bug in one job must not stop the thread
                logger.exception("cold tier job failed")
                if job is not None:
                    self._report(
                        Outcome(job.operation, job.owner, degraded=Degradation.ERROR, detail=str(error))
                    )
            finally:
                if job is not None and job.blocks:
                    self._write_buffer.give_back(job.num_bytes)
                jobs.task_done()

    def _report(self, outcome: Outcome) -> None:
        self._outcomes.put(outcome)
        self._wake()

    def _run(self, job: Job) -> Outcome:
        """One job's calls. Loads are skipped while backing off (a request may be waiting for them);
        writes are always tried: nothing waits for them, and they find out when the store is back."""
        try:
            return self._try(job)
        finally:
            if job.watch_id is not None:
                self._give_ups.cancel(job.watch_id)

    def _try(self, job: Job) -> Outcome:
        if self.is_backing_off and job.operation in LOADS:
            return Outcome(job.operation, job.owner, degraded=Degradation.UNAVAILABLE, detail="backing off")
        if job.deadline_s is not None and job.deadline_s <= time.monotonic():
            late = "its deadline passed in the queue"
            return Outcome(job.operation, job.owner, degraded=Degradation.DEADLINE, detail=late)
        namespace = Namespace(store_tenant(job.tenant), self.model_id)
        call = CallOptions(namespace, self.config.deadline_ms / 1000, job.trace_metadata)
        try:
            return self._call(job, call)
        except grpc.RpcError as error:
            self._down_until = time.monotonic() + self.config.retry_after_s
            reason = _degradation_of(error)
            return Outcome(job.operation, job.owner, degraded=reason, detail=_status_text(error))

    def _call(self, job: Job, call: CallOptions) -> Outcome:
        if job.operation is Operation.LOAD_PREFIX:
            return self._load_prefix(job, call)
        if job.operation is Operation.LOAD_WINDOW:
            return self._loaded(job, self._client.get(list(job.hashes), call))
        if job.operation is Operation.PREFETCH:
            self._client.prefetch(list(job.hashes), call)
            return Outcome(job.operation, job.owner)
        if job.operation is Operation.DELETE:
            self._client.delete(list(job.hashes), call)
            return Outcome(job.operation, job.owner)
        if job.ready is not None:
            job.ready()
        transfer = dataclasses.replace(call, timeout_s=self.config.transfer_deadline_ms / 1000)
        prune = self.config.prune_tokens and job.operation is Operation.DEMOTE  # window-only blocks
        result = self._client.put([self._encode(b, prune) for b in job.blocks], transfer)
        return Outcome(job.operation, job.owner, stored=(*result.stored, *result.duplicates))

    def _load_prefix(self, job: Job, call: CallOptions) -> Outcome:
        """Write the longest run of `job.hashes` the store holds and serves intact, from the first,
        into the job's sink; the outcome comes once it has all landed."""
        assert job.layout is not None and job.sink is not None, "a prefix load says where its blocks go"
        left_s = self._prefix_time_left(job)
        transfer = dataclasses.replace(call, timeout_s=left_s)  # the whole load, its lookups too
        call = dataclasses.replace(call, timeout_s=min(self.config.deadline_ms / 1000, left_s))
        if job.fence is not None:
            job.sink.wait_for(job.fence)
        fetched = self._prefixes.fetch(job.hashes, job.layout, job.sink, call, transfer)
        if fetched.first_bad is None:
            return Outcome(
                job.operation,
                job.owner,
                prefix_blocks=fetched.num_blocks,
                num_read_locally=fetched.num_read_locally,
            )
        return Outcome(
            job.operation, job.owner, degraded=Degradation.CORRUPT, prefix_blocks=fetched.num_blocks,
            num_read_locally=fetched.num_read_locally,
            detail=f"block {fetched.first_bad[:16]} missing or corrupt: the loaded prefix ends before it",
        )  # fmt: skip

    def _prefix_time_left(self, job: Job) -> float:
        """Seconds a prefix load may still take: to its deadline, at most the transfer deadline."""
        left_s = self.config.transfer_deadline_ms / 1000
        if job.deadline_s is not None:
            left_s = min(left_s, job.deadline_s - time.monotonic())
        return max(left_s, 1e-3)

    def _loaded(self, job: Job, fetched: Mapping[str, FetchedBlock | MissReason]) -> Outcome:
        """A window's decoded blocks, every good one (pruned ones too: their kept tokens fill pages)."""
        blocks: list[LoadedBlock] = []
        bad: list[str] = []
        expected = job.window_shape
        for block_hash in job.hashes:
            item = fetched.get(block_hash, MissReason.ABSENT)
            decoded = None if isinstance(item, MissReason) else _decode(item, self.page_tokens, expected)
            if decoded is None:
                bad.append(block_hash)
                continue
            blocks.append(LoadedBlock(BlockHash(block_hash), *decoded))
        if bad:
            detail = f"{len(bad)} block(s) missing, corrupt or not {_expected(expected)}, first {bad[0][:16]}"
            return Outcome(
                job.operation, job.owner, loaded=tuple(blocks), degraded=Degradation.CORRUPT, detail=detail
            )
        return Outcome(job.operation, job.owner, loaded=tuple(blocks))

    def _encode(self, block: BlockToStore, prune: bool) -> BlockIn:
        if block.codec is Codec.RAW:
            stacked = torch.stack([block.keys, block.values], dim=1).to(torch.bfloat16)  # [L, 2, T, KVH, D]
            payload = stacked.contiguous().view(torch.int16).numpy().tobytes()
            return BlockIn(block.block_hash, Codec.RAW, tuple(stacked.shape), payload)
        keys = block.keys.float()
        if prune:
            payload = encode_block(keys, block.values.float(), key_norm_mass(keys), self._pruning)
        else:  # every token kept: INT2 is the only loss
            payload = encode_block(keys, block.values.float(), torch.ones(keys.shape[1]), self._keep_all)
        shape = tuple(read_layout(payload).dense_shape)  # [L, 2, T, KVH, D]
        return BlockIn(block.block_hash, Codec.INT2_SPARSE, shape, payload)


def key_norm_mass(keys: torch.Tensor) -> torch.Tensor:
    """A stand-in for the attention mass each token of a block draws: keys `[L, T, KVH, D]` -> `[T]`.

    Devoto et al. (2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression")
    found that keys with a low L2 norm draw high attention. Per layer and kv head, the key norms
    are standardised over the block (z, free of each model's norm scale and head dim) and the
    tokens get softmax(-z): attention's form, for a query whose logit falls by one per standard
    deviation of key norm. The mean over layers and heads is one distribution over T (it sums to
    1), which the codec's entropy rule reads as attention mass; equal norms give even mass, which
    the rule keeps whole. The proxy needs no query, so every demoted block has one, prefill's too.
    The unit slope keeps the rule's thresholds meaning about what they mean for attention: the
    median 32-token block entropy is 0.962 against real attention's 0.959 on SmolLM2-135M
    (bench/results/cold_tier_pruning_2026-12-02.md) and 0.975 against 0.968 on stories260K (a
    one-off run); -||k||/sqrt(D), a unit-norm query, gave 0.999 on SmolLM2, where the rule then
    never pruned. As a ranking it is no oracle: keeping half of each block by it, by real
    attention mass or at random changes the emulated KL about equally on SmolLM2 (see that page);
    on stories260K it beat random (attention error 0.033 against 0.040; real mass 0.027).
    """
    norms = keys.float().norm(dim=-1)  # [L, T, KVH]
    mean = norms.mean(dim=1, keepdim=True)
    # norms within a thousandth of each other count as equal: rounding is not a ranking
    spread = torch.maximum(norms.std(dim=1, correction=0, keepdim=True), 1e-3 * mean + 1e-6)
    z = (norms - mean) / spread
    return torch.softmax(-z, dim=1).mean(dim=(0, 2))  # [T]


def store_tenant(cache_salt: str) -> str:
    """The kvstore tenant of a cache salt: the salt itself (the gateway's tenant name) when the store
    takes it as a name, else its SHA-256 (a direct caller may send any string)."""
    if not cache_salt:
        return DEFAULT_TENANT
    if cache_salt.isprintable() and len(cache_salt.encode()) <= MAX_NAME_BYTES:
        return cache_salt
    return hashlib.sha256(cache_salt.encode(errors="surrogatepass")).hexdigest()


def _decode(
    block: FetchedBlock, page_tokens: int, expected: WindowShape | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Keys and values `[L, T, KVH, D]` (fp32 or bf16) of a served window block, or of its K kept
    tokens `[L, K, KVH, D]` when it was pruned; None when it does not decode, is pruned unusably,
    is not the `expected` shape, or holds a value that is not finite.

    A pruned block is usable only when its kept tokens fill whole pages of `page_tokens` (what
    `_encode` writes): a partial page would attend whatever its other slots hold. The store is
    not trusted for the rest either: a block of another shape would be mapped over pages that are
    not its own, and a NaN would poison every query that attends it. (Prefix blocks never come
    through here: services/engine/kv/prefix_fetch.py writes them into one buffer.)
    """
    try:
        keys, values, num_tokens = _decode_raw(block) if block.codec is Codec.RAW else _decode_int2(block)
    except (CodecError, ValueError, RuntimeError):
        return None
    num_kept = keys.shape[1]
    if num_kept < num_tokens and num_kept % page_tokens:
        return None
    if expected is not None and (keys.shape[0], num_tokens, *keys.shape[2:]) != expected:
        return None
    if not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        return None
    return keys, values


def _decode_raw(block: FetchedBlock) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A raw block's keys and values `[L, T, KVH, D]` (bf16) and T."""
    if len(block.shape) != 5 or block.shape[1] != 2:
        raise ValueError(f"a raw block is [L, 2, T, KVH, D], got {list(block.shape)}")
    raw = np.frombuffer(block.payload, dtype=np.int16).reshape(block.shape)
    stacked = torch.from_numpy(raw.copy()).view(torch.bfloat16)  # [L, 2, T, KVH, D]
    return stacked[:, 0], stacked[:, 1], block.shape[2]


def _decode_int2(block: FetchedBlock) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An INT2-sparse block's kept keys and values `[L, K, KVH, D]` (fp32) and its T."""
    decoded = decode_block(block.payload)
    return decoded.keys, decoded.values, decoded.token_mask.numel()


def _expected(shape: WindowShape | None) -> str:
    if shape is None:
        return "decodable"
    return f"[{shape.num_layers}, {shape.num_tokens}, {shape.num_kv_heads}, {shape.head_dim}]"


def _degradation_of(error: grpc.RpcError) -> Degradation:
    code = error.code() if hasattr(error, "code") else None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Degradation.DEADLINE
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Degradation.UNAVAILABLE
    return Degradation.ERROR


def _status_text(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else ""
    return f"{getattr(code, 'name', 'UNKNOWN')}: {details}"[:200]
