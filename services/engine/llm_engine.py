"""The engine: accepts requests from any thread and runs batched prefill/decode steps on one thread."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from services.common.tenancy import WARM_UP_SALT
from services.engine.attention.backend import prefix_page_bytes
from services.engine.attention.dense_prefill import dense_prefill_bytes
from services.engine.attention.probe import probe_layer
from services.engine.attention.reference import ReferenceBackend
from services.engine.errors import (
    EmptyPrompt,
    EngineStopped,
    InvalidPrompt,
    KVCapacityExceeded,
    KVPoolTooSmall,
    PromptTooLong,
    UnknownRetrievalMode,
)
from services.engine.execution.memory_profile import GRAPH_AND_WORKSPACE_RESERVE_BYTES, profile_memory
from services.engine.execution.model_runner import (
    ModelRunner,
    PreparedStep,
    RunnerOptions,
    StepOutput,
    to_device,
)
from services.engine.execution.sampler import FAULT, sample
from services.engine.execution.tp_workers import CacheShape, RankLost, WorkerGroup
from services.engine.gate.safety_gate import GatePolicy, GateReport, GateStatus, InLoopGate, refusal
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.capacity import (
    GIB,
    KVBudgetTooSmall,
    PoolPlan,
    budget_from_device_memory,
    format_bytes,
    hot_block_bytes,
    longest_fitting_seq_len,
    plan_pools,
    warm_group_bytes,
)
from services.engine.kv.cold_moves import ScoreRow
from services.engine.kv.cold_tier import ColdTier, ColdTierConfig, RetrievalMode
from services.engine.kv.tiers import KVCacheSpec, TierConfig, WarmFullPolicy
from services.engine.metrics import QUEUE_WAIT
from services.engine.model.checkpoint import Checkpoint
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaModel
from services.engine.model.loader import load_model, open_checkpoint, resolve_device, resolve_dtype
from services.engine.model.registry import resolve_model
from services.engine.model.tensor_parallel import SINGLE
from services.engine.scheduling.cold_planner import ColdPlanner, ColdStats
from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.scheduler import ExpiredRequest, ScheduledBatch, Scheduler, StepKind
from services.engine.scheduling.sequence import (
    EventCallback,
    FinishReason,
    RequestId,
    Sequence,
    SequenceStatus,
    StreamEvent,
)
from services.engine.serving.generation_result import GenerationResult, ResultCollector
from services.engine.text.tokenizer import Tokenizer

__all__ = [
    "EngineStats",
    "FinishReason",
    "GenerationResult",
    "LLMEngine",
    "RequestHandle",
    "RequestId",
    "SamplingParams",
    "StreamEvent",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 4096  # padded prompt tokens per prefill step
# With tiers on, every 64th decode step samples the hot attention mass of one row. That step runs eagerly
# (outside the decode graphs), so the period keeps its cost near 1% of decode time.
PROBE_EVERY_DECODE_STEPS = 64


@dataclass(frozen=True)
class RequestHandle:
    """Returned by `submit`; pass it (or its id) to `cancel`."""

    request_id: RequestId


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters."""

    num_running: int
    num_waiting: int
    num_free_slots: int
    max_batch_size: int
    max_seq_len: int
    num_steps: int
    num_prompt_tokens_total: int
    num_generated_tokens_total: int
    num_requests_finished: int
    num_preemptions: int = 0
    num_prompt_tokens_cached: int = 0
    num_hot_tokens: int = 0
    num_hot_capacity_tokens: int = 0
    hot_bytes: int = 0
    num_warm_tokens: int = 0
    num_warm_capacity_tokens: int = 0
    warm_bytes: int = 0
    num_dropped_tokens: int = 0
    hot_attention_mass: float = 1.0  # last sampled share of attention mass on hot tokens
    num_prefill_tokens_computed: int = 0  # prompt tokens run through the model (cached ones are not)
    cold: ColdStats | None = None  # the kvstore tier's counters (None: no cold tier)


class Sampled(NamedTuple):
    """One sequence's outcome of a step: its sampled token and the gate categories that fired."""

    seq: Sequence
    token_id: int
    fired: tuple[str, ...]  # empty: the in-loop gate let the token through


class PendingText(NamedTuple):
    """A committed token whose text (and event) is still to come: see `LLMEngine._flush_text`."""

    seq: Sequence
    token_id: int
    ended: bool  # the token itself ended the sequence (EOS or length)


class Ahead(NamedTuple):
    """A step scheduled and prepared while the one before it ran, and maybe launched already."""

    batch: ScheduledBatch
    step: PreparedStep
    output: StepOutput | None = None  # launched on the last step's sampled ids, not yet synced (overlap)


class LLMEngine:
    """Continuous-batching generation over one model on one device.

    A step's critical path, from the device's last output to the next launch, holds only what the
    next step needs: token ids, EOS and length, and the schedule. Each token's text (detokenizing,
    stop strings, the event to the caller) is made while the next step runs on the device.
    """

    def __init__(
        self,
        model_id: str,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        tiers: TierConfig | None = None,
        classes: IntentClasses | None = None,
        overlap: bool | None = None,
        mixed_steps: bool = True,
    ) -> None:
        self.model_id = model_id
        # Overlapped steps: a decode step whose rows all sampled in the step before is launched on
        # those sampled ids while they are still on the device, before the host syncs on them, so
        # the device never waits for the host's work between steps (committing tokens, scheduling,
        # launching). Default: with CUDA graphs, where that host work is the gap between steps.
        self.overlap = runner.graphs is not None if overlap is None else overlap
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tiers = tiers or TierConfig()
        self.scheduler = Scheduler(
            runner.kv_cache, max_batch_size, max_prefill_tokens, classes, model_id, mixed_steps=mixed_steps
        )
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._turn_token_ids = self._eos_token_ids | frozenset(tokenizer.turn_start_ids())
        self._lock = threading.Condition()
        self._step_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._cancels: deque[RequestId] = deque()
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._is_stalled = False  # the last step found nothing to run (see `_wait_for_work`)
        self._counters = dict.fromkeys(
            ("steps", "prompt_tokens", "generated_tokens", "finished", "dropped", "row_faults"), 0
        )
        self._num_decode_steps = 0
        self._num_overlapped_steps = 0  # steps launched before the last one's sync (tests read it)
        self._is_step_committed = False  # whether the running step's rows have been advanced
        self._lost_rank: str | None = None  # set when a tensor-parallel rank has exited
        self._hot_attention_mass = 1.0
        self._gate: InLoopGate | None = None
        self.gate_report = GateReport(GateStatus.ABSENT, detail="no gate installed")
        self._gate_triggers: dict[str, int] = {}
        self._pending_text: list[PendingText] = []  # the last step's tokens, text not yet made
        self._ahead: Ahead | None = None  # the next step, scheduled and prepared during this one
        self._tables_changed = False  # block tables changed after `_ahead` was prepared
        self.capacity: PoolPlan | None = None  # the KV pools `load` planned (None for a hand-built engine)
        self.cold: ColdPlanner | None = None  # the kvstore tier (`attach_cold_tier`)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 16,
        max_seq_len: int | None = None,
        progress: bool = True,
        kv: KVCacheSpec | None = None,
        classes: IntentClasses | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        tp: int = 1,
        attention: str = "auto",
        cuda_graphs: bool = True,
        checkpoint: Checkpoint | None = None,
        cold: ColdTierConfig | None = None,
        overlap: bool | None = None,
        mixed_steps: bool = True,
        warm_up: bool = False,
    ) -> LLMEngine:
        """Load an HF directory, a `.gguf` file or a registered model name.

        With `tp` > 1 this process becomes rank 0 of a tensor-parallel group and starts ranks
        1..tp-1 itself (gloo on the CPU, NCCL with one GPU per rank); `stop` ends them.
        `attention` picks the backend ("auto": fused Triton on CUDA, the reference elsewhere) and
        `cuda_graphs` whether decode steps are captured (CUDA only). A `checkpoint` already opened
        (benchmarks pass random weights this way) is used instead of reading `path` (TP=1 only).
        `overlap` launches a decode step before the last one's sync (see `LLMEngine.overlap`; None:
        with CUDA graphs). `mixed_steps`: running streams decode beside prompt chunks (`Scheduler`).
        `warm_up` runs `LLMEngine.warm_up` before the engine is handed back (the service does).
        """
        kv = kv or KVCacheSpec()
        classes = classes or IntentClasses.builtin()
        model_path = resolve_model(path) if checkpoint is None else Path(path)
        checkpoint = checkpoint or open_checkpoint(model_path)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        positions = _check_max_seq_len(checkpoint.config, max_seq_len)
        kv.tiers.check_head_dim(checkpoint.config.head_dim)  # before any weight is read
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        classes.check_fits(max_batch_size)  # before any weight is read, as the scheduler will
        workers = None
        if tp > 1:
            workers = WorkerGroup.launch(
                str(model_path), checkpoint.config, torch_device, torch_dtype, positions, tp
            )
            torch_device = workers.spec.device(0)
        try:
            model = load_model(
                checkpoint, torch_device, torch_dtype, positions, progress, workers.tp if workers else SINGLE
            )
            plan = _plan_kv_pools(
                model, kv, classes, torch_device, torch_dtype, attention, max_batch_size, max_seq_len,
                max_prefill_tokens,
            )  # fmt: skip
            cache = _build_kv_cache(model.rank_config, kv, plan, torch_device, torch_dtype)
            options = RunnerOptions(
                attention, cuda_graphs, max_batch_size, plan.max_seq_len, chunk_tokens=max_prefill_tokens
            )
            if workers is not None:
                workers.start(CacheShape.of(cache), options)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        runner = ModelRunner(model, cache, torch_device, workers, options)
        runner.capture_graphs()
        logger.info("%s", plan.describe())
        engine = cls(
            checkpoint.model_id, runner, checkpoint.tokenizer, max_batch_size, plan.max_seq_len,
            max_prefill_tokens, kv.tiers, classes, overlap, mixed_steps,
        )  # fmt: skip
        engine.capacity = plan
        if warm_up:
            engine.warm_up()
        if cold is not None and cold.enabled and tp > 1:
            logger.warning("the cold tier runs at tensor parallelism 1 only; serving without it (tp=%d)", tp)
        elif cold is not None and cold.enabled:
            engine.attach_cold_tier(cold)
        return engine

    def warm_up(self) -> float:
        """Serve three made-up requests so that the fused kernels a long prompt meets are compiled now,
        not on the first real requests: whole prompt chunks, chunks over a cached prefix (the dense
        path's library kernels and the warm tier's pages), short and long last chunks over it, and
        decode rows beside chunks. On a machine whose Triton cache is empty those compiles take
        seconds on an 8B model. CUDA with the fused backend only (elsewhere nothing compiles); the
        requests carry their own cache salt, so no real prompt shares their blocks. They reach the
        batch and queue-wait histograms, not the per-request metrics (the servicer records those).
        Returns the seconds it took."""
        if not self._compiles_kernels():
            return 0.0
        started = time.perf_counter()
        collectors = []
        chunk = self.scheduler.max_prefill_tokens
        for prompt, new_tokens in warm_up_requests(self.config.vocab_size, chunk, self.max_seq_len):
            collector = ResultCollector(prompt)
            params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            try:
                self.submit(prompt, params, collector, cache_salt=WARM_UP_SALT)
            except (InvalidPrompt, KVCapacityExceeded) as error:  # a small pool or sequence limit
                logger.info("warm-up: a %d-token request left out (%s)", len(prompt), error)
                continue
            collectors.append(collector)
        while not all(c.done.is_set() for c in collectors):
            self.step()
        elapsed = time.perf_counter() - started
        logger.info("warm-up: the prefill kernels ran (and compiled where new) in %.1f s", elapsed)
        return elapsed

    def _compiles_kernels(self) -> bool:
        """Whether steps run kernels compiled on first use: the fused backend on CUDA."""
        return self.runner.device.type == "cuda" and not isinstance(self.runner.attention, ReferenceBackend)

    def attach_cold_tier(self, config: ColdTierConfig) -> None:
        """Use the kvstore at `config.target` for prefix reuse, demotion and the auxiliary window."""
        num_layers = self.runner.model.rank_config.num_layers
        if config.score_layer >= num_layers:
            raise ValueError(
                f"the cold tier's score layer {config.score_layer} is past the model's {num_layers} layers "
                "(THERMOCLINE_ENGINE_AUX_SCORE_LAYER; -1 picks the middle layer)"
            )
        tier = ColdTier(config, self.model_id, wake=self._wake, page_tokens=self.runner.kv_cache.block_size)
        self.runner.attach_cold_tier(tier)
        assert self.runner.cold_summaries is not None
        max_prefix_blocks = (self.max_seq_len - 1) // self.runner.kv_cache.block_size
        self.cold = ColdPlanner(
            tier, self.runner.kv_cache, self.runner.cold_summaries, max_prefix_blocks, self.scheduler.classes
        )
        self.scheduler.cold = self.cold

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    @property
    def config(self) -> ModelConfig:
        """The model's architecture."""
        return self.runner.model.config

    def set_safety_gate(self, head: InLoopGate | None, report: GateReport) -> None:
        """Installs the in-loop gate (None: ungated) and what GetModelInfo and /metrics say about it.

        Called again whenever a re-check of safety's gate changes the report (gate_watch.py); the
        trigger counts of categories the new head shares with the old one carry on.
        """
        with self._step_lock:
            self._gate = head
            self.gate_report = report
            self._gate_triggers = {
                c: self._gate_triggers.get(c, 0) for c in (head.categories if head else ())
            }

    def safety_gate_triggers(self) -> dict[str, int]:
        """Sequences the in-loop gate ended, per category (a sequence counts in each category that fired)."""
        return dict(self._gate_triggers)

    # --- thread-safe API -------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_event: EventCallback,
        intent_class: str = "",
        cache_salt: str = "",
        retrieval_mode: str = "",
        trace_metadata: tuple[tuple[str, str], ...] = (),
        gate_policy: GatePolicy | None = None,
    ) -> RequestHandle:
        """Queue a request; `on_event` is then called on the engine thread for each step's output.

        `intent_class` picks the scheduling class (empty: `default`); `cache_salt` keeps this
        tenant's prefix-cache blocks apart from everyone else's; `retrieval_mode` (`off` or
        `semantic`; empty: the class's or the deployment's default) turns the auxiliary window of
        cold blocks on; `trace_metadata` (a `traceparent`) joins its kvstore calls to its trace;
        `gate_policy` is the tenant's change to the in-loop gate (categories off, looser thresholds).
        """
        if self._is_stopping:
            raise EngineStopped("the engine is stopped; it accepts no new requests")
        if self._lost_rank is not None:
            raise EngineStopped(f"{self._lost_rank}; send the request to another replica")
        if self.gate_report.is_refusing:
            raise refusal(self.gate_report)
        self._check_prompt(prompt_ids)
        cls = self.scheduler.classes.get(intent_class)
        params = _capped(params, cls)
        tiers = self._tiers_for(cls)
        total = len(prompt_ids) + params.max_new_tokens
        if tiers.enabled and tiers.policy is WarmFullPolicy.REFUSE and total > tiers.max_tokens:
            raise KVCapacityExceeded(total, tiers.max_tokens)
        pool_tokens = self.runner.kv_cache.hot.capacity_tokens()
        if not tiers.enabled and min(total, self.max_seq_len) > pool_tokens:
            raise KVPoolTooSmall(min(total, self.max_seq_len), pool_tokens)
        mode = self._retrieval_mode(retrieval_mode, cls)
        seq = self._new_sequence(list(prompt_ids), params, on_event, tiers, cache_salt, cls.name)
        seq.uses_aux_window = tiers.enabled and mode is RetrievalMode.SEMANTIC
        seq.block_table.keeps_cold = seq.uses_aux_window
        seq.trace_metadata = trace_metadata
        seq.gate_policy = gate_policy or None
        self._mark_turn(seq, seq.prompt_ids, 0)
        with self._lock:
            self._inbox.append(seq)
            self._lock.notify()
        return RequestHandle(seq.request_id)

    def _retrieval_mode(self, asked: str, cls: IntentClass) -> RetrievalMode:
        """The request's mode, else its class's, else the deployment's; `off` without a cold tier."""
        known = [m.value for m in RetrievalMode]
        if asked and asked not in known:
            raise UnknownRetrievalMode(asked, known)
        if self.cold is None:
            return RetrievalMode.OFF
        return RetrievalMode(asked or cls.retrieval_mode or self.cold.config.retrieval_mode.value)

    def cancel(self, handle_or_request_id: RequestHandle | RequestId | str) -> None:
        """Cancel a request: slot freed before the next step, final CANCELLED event; unknown ids ignored."""
        request_id = getattr(handle_or_request_id, "request_id", handle_or_request_id)
        with self._lock:
            self._cancels.append(RequestId(str(request_id)))
            self._lock.notify()

    def health_problem(self) -> str | None:
        """Why this engine cannot serve (a lost tensor-parallel rank), or None; polled for health."""
        return self._lost_rank or self.runner.lost_rank()

    def stats(self) -> EngineStats:
        """Current load and lifetime counters."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting + len(self._inbox),
            num_free_slots=self.max_batch_size - len(self.scheduler.running),
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            num_steps=self._counters["steps"],
            num_prompt_tokens_total=self._counters["prompt_tokens"],
            num_generated_tokens_total=self._counters["generated_tokens"],
            num_requests_finished=self._counters["finished"],
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_cached=self.scheduler.num_prompt_tokens_cached,
            num_dropped_tokens=self._counters["dropped"],
            hot_attention_mass=self._hot_attention_mass,
            num_prefill_tokens_computed=self.scheduler.num_prefill_tokens_computed,
            cold=None if self.cold is None else dataclasses.replace(self.cold.stats),
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict[str, int]:
        cache = self.runner.kv_cache
        hot, warm = cache.hot, cache.warm
        return {
            "num_hot_tokens": hot.num_used_tokens(),
            "num_hot_capacity_tokens": hot.capacity_tokens(),
            "hot_bytes": hot.used_bytes(),
            "num_warm_tokens": warm.num_used_tokens() if warm else 0,
            "num_warm_capacity_tokens": warm.capacity_tokens() if warm else 0,
            "warm_bytes": warm.used_bytes() if warm else 0,
        }

    def start(self) -> None:
        """Start the background step thread (idempotent)."""
        if self._thread is not None:
            return
        self._is_stopping = False
        self._is_stalled = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.model_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the step thread; requests still in flight end with CANCELLED."""
        with self._lock:
            self._is_stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._step_lock:
            self._cancel_everything()
            self.runner.close()
            if self.cold is not None:
                self.cold.tier.close()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion as one batch and return results in prompt order (blocking)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        collectors = [ResultCollector(p) for p in prompts]
        for prompt, p, collector in zip(prompts, per_prompt, collectors, strict=True):
            self.submit(prompt, p, collector)
        for collector in collectors:
            while not collector.done.is_set():
                if self._thread is None:
                    self.step()
                else:
                    collector.done.wait()
        return [c.result() for c in collectors]

    # --- engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._wait_for_work()
                if self._is_stopping:
                    return
            try:
                self.step()
            except Exception:  # keep serving; step() already fails the requests it could not run
                logger.exception("engine loop error")

    def _wait_for_work(self) -> None:
        """Sleep (under `_lock`, which waiting lets go) until a step has something to do.

        After a step that found nothing to run, requests still queued are no reason to step again:
        none of them could start (other classes' reserved slots, no free blocks), and only news
        changes that: a new request, a cancel, a kvstore outcome, or the next queue timeout, which
        ends a request. So the thread sleeps until one of those comes, instead of spinning through
        empty steps (a core at 100% until the queue timed out).
        """
        if self._is_stalled and not self._has_news():
            self._lock.wait(self.scheduler.seconds_to_next_expiry())
        self._is_stalled = False
        while not (self._has_news() or self._has_work()):
            self._lock.wait()

    def _has_news(self) -> bool:
        """A reason to step that the last step did not see: stop, a request, a cancel, a kvstore outcome."""
        return (
            self._is_stopping
            or bool(self._inbox)
            or bool(self._cancels)
            or (self.cold is not None and self.cold.tier.has_outcomes)
        )

    def _has_work(self) -> bool:
        """Something to schedule, text to emit, a kvstore outcome to take, or a prefix load to start
        (held until tier moves are carried out: with no step coming, `step` carries them out)."""
        return (
            self.scheduler.has_work
            or bool(self._pending_text)
            or self._ahead is not None
            or (self.cold is not None and (self.cold.tier.has_outcomes or self.cold.tier.has_fenced))
        )

    def step(self) -> None:
        """Take in new requests and cancels, then run one prefill or decode step and emit its events.

        The step was usually scheduled and prepared while the last one ran on the device
        (`_schedule_ahead`); otherwise it is scheduled now.
        """
        with self._step_lock:
            self._drain_inbox()
            self._take_cold_outcomes()
            self._expire_waiting()
            ahead, self._ahead = self._ahead, None
            if ahead is None:
                batch = self.scheduler.schedule()
                self._record_queue_waits()
                if batch is None:
                    self._flush_text()
                    self.runner.carry_out_moves()  # no step comes to start held prefix loads
                    self._is_stalled = True
                    return
                ahead = Ahead(batch, self._prepare(batch))
            batch = ahead.batch
            self._is_step_committed = False
            try:
                token_ids = self._run(batch, ahead.step, ahead.output)
            except RankLost as exc:  # the group is gone: fail fast now and refuse new work
                logger.critical("%s", exc)
                self._lost_rank = str(exc)
                self._fail(batch, exc, error_status="unavailable")
                return
            except Exception as exc:  # a failed step must not take the engine down
                self._fail_step(batch, exc)
                return
            self._counters["steps"] += 1
            self._commit(batch, token_ids)

    def _take_cold_outcomes(self) -> None:
        """Apply the kvstore's outcomes; requests whose prefix came back join their queues.

        A caller stepping by hand with nothing else to run waits for one (the step thread instead
        sleeps until a kvstore thread wakes it).
        """
        if self.cold is None:
            return
        if self._thread is None and not self.scheduler.has_work and self.cold.num_held:
            self.runner.carry_out_moves()  # no step comes to start the held loads
            self.cold.tier.wait_for_outcome(timeout_s=2 * self.cold.config.deadline_ms / 1000)
        for seq in self.cold.take_ready():
            self.scheduler.add(seq)

    def _record_queue_waits(self) -> None:
        for intent_class, waited_s in self.scheduler.take_queue_waits():
            QUEUE_WAIT.labels(intent_class).observe(waited_s)

    def _prepare(self, batch: ScheduledBatch) -> PreparedStep:
        return self.runner.prepare(batch.rows, self._probe_layer(batch), self._cold_score_rows(batch))

    def _schedule_ahead(self, batch: ScheduledBatch, sampling: list[Sequence]) -> Ahead | None:
        """Schedule and prepare the next step while this one runs on the device.

        Its tokens are not known yet. A row whose token ends it by length is left out. One that
        EOS, a stop string, a fault or a cancel ends meanwhile stays in as a dead row: it computes
        into blocks it has released (no later step can reuse them before this one has run, in stream
        order), and its token is dropped. Cold-tier window loads that remap hot blocks before the
        launch make `ModelRunner.launch` build the metadata again.
        """
        ending = {id(seq) for seq in sampling if seq.ends_by_length_after_one(self.max_seq_len)}
        self._drain_inbox()
        self._take_cold_outcomes()
        self._expire_waiting()
        upcoming = self.scheduler.schedule(ending)
        self._record_queue_waits()
        return None if upcoming is None else Ahead(upcoming, self._prepare(upcoming))

    def _run(
        self, batch: ScheduledBatch, step: PreparedStep, launched: StepOutput | None = None
    ) -> list[Sampled]:
        if launched is None:
            tables_changed, self._tables_changed = self._tables_changed, False
            output = self.runner.launch(step, tables_changed)
        else:  # overlapped: launched during the last step, before its sync
            output = launched
        self._record_attention(batch)
        self._is_step_committed = True  # from here a failure leaves every row's state half done
        done = self.scheduler.commit_computed(batch)
        self._counters["dropped"] += self.scheduler.num_dropped_tokens_last_step
        if not done:  # a prefill chunk that ends mid-prompt samples nothing
            self._flush_text()
            return []
        if len(done) == len(batch.rows):
            rows = None
        else:  # by identity: `seq in done` would compare every row with every sequence
            done_ids = {id(seq) for seq in done}
            rows = self._row_index([id(r.seq) in done_ids for r in batch.rows])
        logits = output.logits if rows is None else output.logits[rows]
        params = [s.params for s in done]
        draw_keys = [(s.seed or 0, len(s.completion_ids)) for s in done]
        token_ids = sample(logits, params, draw_keys)  # [B] on the device
        flags = self._gate_flags(output.hidden_states, rows)  # [B, C] bool on the device, or None
        self._flush_text()  # the last step's text, while the device runs this one
        self._ahead = self._schedule_ahead(batch, done)  # and the next step
        fetch = PendingFetch(token_ids, flags)  # the copy is queued before the next step's launch
        # after the sync, a probe reads its mass, cold scoring its scores, and a tenant's gate policy
        # the hidden states, which the next step's graph replay would overwrite: those steps wait
        reads_output = (
            output.hot_mass is not None
            or output.window_scores is not None
            or (self._gate is not None and any(seq.gate_policy is not None for seq in done))
        )
        if self._ahead is not None and not reads_output:
            self._ahead = self._launch_ahead(self._ahead, done, token_ids)
        token_list, flag_rows = fetch.wait()  # the step's one host sync
        if output.hot_mass is not None:  # sampled step: the sync above already waited for it
            self._hot_attention_mass = float(output.hot_mass.item())
            probed = batch.rows[output.probe_row % len(batch.rows)].seq
            if not probed.is_finished:
                self._move_hot_boundary(probed)
        fired: list[tuple[str, ...]] = (
            [self._gate.fired(f) for f in flag_rows] if self._gate and flag_rows else [()] * len(done)
        )
        if any(fired):
            fired = self._apply_gate_policies(done, fired, output.hidden_states, rows)
        self._choose_cold_windows(batch, output.window_scores)
        return [Sampled(*item) for item in zip(done, token_list, fired, strict=True)]

    def _launch_ahead(self, ahead: Ahead, sampled: list[Sequence], token_ids: torch.Tensor) -> Ahead:
        """Launch the next step now, on this step's sampled ids still on the device, when it can be.

        It can when overlap is on, every row of it decodes the token this step sampled for it, and
        nothing after this step's sync must change it first: no tensor-parallel ranks (they take ids
        from the plan), no cold tier (its window loads remap tables after the sync), no probe or
        cold scoring in it. A row that this step's token ends (EOS, a fault, the gate) computes as a
        dead row, as in any step prepared ahead; a fault's id is clamped to a valid one for that.
        """
        plan = ahead.step.plan
        if (
            not self.overlap
            or ahead.batch.kind is not StepKind.DECODE
            or self._tables_changed
            or self.cold is not None
            or self.runner.model.tp.is_parallel
            or plan.probe_layer is not None
            or plan.score_rows
        ):
            return ahead
        index = {id(seq): i for i, seq in enumerate(sampled)}
        # a row's input is the in-flight token only when every token it holds is computed: a row
        # re-admitted after a preemption, with its prompt's last token left, is not (its input is
        # that prompt token)
        rows = [
            index.get(id(row.seq), -1) if row.seq.num_computed_tokens == row.seq.num_tokens else -1
            for row in ahead.step.rows
        ]
        if -1 in rows:
            return ahead
        if rows == list(range(len(sampled))):
            ids = token_ids
        else:
            ids = token_ids[to_device(np.asarray(rows, dtype=np.int64), token_ids.device)]
        try:
            output = self.runner.launch(ahead.step, input_ids=ids.clamp(min=0))
        except Exception:  # launched again after the sync, where a failure fails that step alone
            logger.exception("an overlapped launch failed; the step launches again after the sync")
            return ahead
        self._num_overlapped_steps += 1
        return ahead._replace(output=output)

    def _apply_gate_policies(
        self,
        done: list[Sequence],
        fired: list[tuple[str, ...]],
        hidden: torch.Tensor,
        rows: torch.Tensor | None,
    ) -> list[tuple[str, ...]]:
        """Where a row fired and its request carries a tenant policy, the categories that policy keeps."""
        assert self._gate is not None
        kept = list(fired)
        for i, (seq, categories) in enumerate(zip(done, fired, strict=True)):
            if categories and seq.gate_policy is not None:
                state = hidden[i] if rows is None else hidden[rows[i]]
                kept[i] = self._gate.fired_under(seq.gate_policy, categories, state)
        return kept

    def _move_hot_boundary(self, seq: Sequence) -> None:
        """The measured row's warm tier drew too much attention: its hot window grows one group."""
        tiers = seq.block_table.tiers
        if self._hot_attention_mass >= tiers.grow_below_hot_mass:
            return
        if self.runner.kv_cache.grow_hot(seq.block_table):
            seq.add_event(
                "thermocline.kv.hot_grown",
                {
                    "thermocline.kv.hot_attention_mass": self._hot_attention_mass,
                    "thermocline.kv.hot_tokens": seq.block_table.tiers.hot_tokens,
                },
            )

    def _mark_turn(self, seq: Sequence, token_ids: Seq[int], start: int) -> None:
        """With `restart_hot_at_turns`, the hot window restarts at the last turn boundary in `token_ids`."""
        if not seq.block_table.tiers.restart_hot_at_turns:
            return
        for offset in range(len(token_ids) - 1, -1, -1):
            if token_ids[offset] in self._turn_token_ids:
                seq.block_table.hot_floor = max(seq.block_table.hot_floor, start + offset)
                return

    def _cold_score_rows(self, batch: ScheduledBatch) -> list[ScoreRow]:
        if self.cold is None or batch.kind is not StepKind.DECODE:  # prefill and mixed steps score nothing
            return []
        return self.cold.rows_to_score([r.seq for r in batch.rows])

    def _choose_cold_windows(
        self, batch: ScheduledBatch, scored: list[tuple[ScoreRow, torch.Tensor]] | None
    ) -> None:
        """Read each scored row's best cold blocks (the step's sync has passed) and load them."""
        if self.cold is None or not scored:
            return
        for row, best in scored:
            seq = batch.rows[row.row].seq
            if not seq.is_finished:  # a stop string in the last step's text ended it meanwhile
                self.cold.choose_window(seq, best.tolist())
        self._tables_changed = True  # unmapped window blocks: the step prepared ahead is rebuilt

    def _row_index(self, is_done: list[bool]) -> torch.Tensor:
        """`[B]` rows that sample this step (a batch where some rows are still mid-prompt)."""
        # one copy, shared by the logits and the gate; pinned, so that it does not wait for an
        # overlapped step already queued
        rows = np.asarray([i for i, d in enumerate(is_done) if d], dtype=np.int64)
        return to_device(rows, self.runner.device)

    def _gate_flags(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The gate on every sampling row's final normed state (prompt end and each decode step)."""
        if self._gate is None:
            return None
        return self._gate.flags(hidden if rows is None else hidden[rows])  # [B, C]

    def _probe_layer(self, batch: ScheduledBatch) -> int | None:
        if batch.kind is not StepKind.DECODE or not self.tiers.enabled:  # prefill, or nothing is ever warm
            return None
        self._num_decode_steps += 1
        if self._num_decode_steps % PROBE_EVERY_DECODE_STEPS:
            return None
        return probe_layer(self.config.num_layers)

    def _record_attention(self, batch: ScheduledBatch) -> None:
        # per row per decode step: kept to plain attribute reads (at batch 256 the device waits on it)
        cache = self.runner.kv_cache
        block_size = cache.block_size
        finished = SequenceStatus.FINISHED
        for seq, num_new in batch.rows:
            if num_new != 1 or seq.status is finished:  # prefill, or a dead row
                continue
            table = seq.block_table
            num_cold = sum(map(len, table.aux_blocks.values())) * block_size if table.aux_blocks else 0
            num_hot = min(cache.num_held_hot_blocks(table) * block_size, seq.num_tokens)
            num_warm = len(table.warm_groups) * table.tiers.group_size
            seq.record_attention(num_hot - num_cold, num_warm, num_cold)

    def _expire_waiting(self) -> None:
        for item in self.scheduler.expire():
            self._counters["finished"] += 1
            if self.cold is not None:
                self.cold.release(item.seq)  # its loaded prefix and cold blocks, if any
            item.seq.finish(FinishReason.ERROR)
            _emit(
                item.seq,
                item.seq.event((), "", error=_timeout_message(item), error_status="deadline_exceeded"),
            )

    def _tiers_for(self, cls: IntentClass) -> TierConfig:
        return _class_tiers(self.tiers, cls)

    def _commit(self, batch: ScheduledBatch, sampled: list[Sampled]) -> None:
        """Take the step's tokens: ids, EOS and length now; their text in `_flush_text`, later.

        A row whose own commit raises fails alone; the rest of the batch takes its tokens.
        """
        num_generated = 0
        for seq, token_id, fired in sampled:
            if seq.status is SequenceStatus.FINISHED:  # a stop string in the last step's text ended it
                continue  # while this step ran: its blocks are free; the token past the stop is dropped
            try:
                num_generated += self._commit_row(seq, token_id, fired)
            except Exception as exc:
                self._fail_one(seq, exc)
        self._counters["generated_tokens"] += num_generated

    def _commit_row(self, seq: Sequence, token_id: int, fired: tuple[str, ...]) -> int:
        """Take one row's token; returns how many tokens it generated (0 or 1)."""
        if token_id == FAULT:  # this row's numbers went bad; its batch neighbours are unaffected
            event = self._end_for_fault(seq)
        elif fired:  # the state that chose this token is over a threshold: drop the token
            event = self._end_for_safety(seq, fired)
        else:
            seq.append_token_id(token_id, self._eos_token_ids, self.max_seq_len)
            if seq.block_table.tiers.restart_hot_at_turns:
                self._mark_turn(seq, (token_id,), seq.num_tokens - 1)
            ended = seq.status is SequenceStatus.FINISHED
            if ended:
                self._end(seq)
            self._pending_text.append(PendingText(seq, token_id, ended))  # last: nothing after it raises
            return 1
        self._end(seq)
        _emit(seq, event)
        return 0

    def _end(self, seq: Sequence) -> None:
        self.scheduler.release(seq)
        self._counters["finished"] += 1

    def _flush_text(self) -> None:
        """Detokenize the last step's tokens, check stop strings, and emit their events.

        Runs while the next step is on the device (or when there is none). A sequence that ended
        since its token was committed (cancelled, failed) already had its last event: its entry is
        dropped. One that a stop string ends here frees its blocks now; the next step computed one
        token for it, which `_commit` drops.
        """
        pending, self._pending_text = self._pending_text, []
        finished = SequenceStatus.FINISHED
        for seq, token_id, ended in pending:
            if seq.status is finished and not ended:
                continue
            try:
                event = seq.text_event(token_id)
            except Exception as exc:  # this sequence's detokenizing or stop check: it fails alone
                self._fail_one(seq, exc)
                continue
            if seq.status is finished and not ended:  # a stop string ended it
                self._end(seq)
            _emit(seq, event)

    def _end_for_fault(self, seq: Sequence) -> StreamEvent:
        logger.error("request %s: non-finite logits or probabilities; failing that row alone", seq.request_id)
        self._counters["row_faults"] += 1
        seq.finish(FinishReason.ERROR)
        return seq.event((), "", error="numerical fault in sampling (non-finite logits); the request ended")

    def _end_for_safety(self, seq: Sequence, fired: tuple[str, ...]) -> StreamEvent:
        """Ends `seq` with the safe message and SAFETY; the rest of the batch carries on."""
        assert self._gate is not None
        for category in fired:
            self._gate_triggers[category] += 1
        seq.add_event(
            "thermocline.safety.triggered",
            {"thermocline.safety.layer": "in_loop", "thermocline.safety.categories": list(fired)},
        )
        seq.finish(FinishReason.SAFETY)
        return seq.event((), self._gate.safe_message)

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A step raised: its requests fail. But when a mixed step fails before anything of it was
        committed (in its forward), its decode rows go on: the prompt chunks beside them are what
        the step added (prompts first, a failing prompt never took running streams down with it).
        Their positions are computed again next step; a decode row that was the cause fails then."""
        if batch.num_decode_rows and not self._is_step_committed:
            chunks = dataclasses.replace(batch, rows=batch.rows[batch.num_decode_rows :], num_decode_rows=0)
            logger.exception(
                "a mixed step failed; failing its %d prompt(s), its %d decoding request(s) go on",
                len(chunks.rows), batch.num_decode_rows,
            )  # fmt: skip
            self._fail(chunks, exc)
            return
        logger.exception("engine step failed; failing %d request(s)", len(batch.seqs))
        self._fail(batch, exc)

    def _fail_one(self, seq: Sequence, exc: Exception) -> None:
        """A stage of one sequence's own raised: that request ends with the error, and its batch
        neighbours carry on. One already ended (its last token's text failed) gets its last event."""
        logger.exception("request %s failed; failing it alone", seq.request_id)
        if self.scheduler.remove(seq.request_id, FinishReason.ERROR) is not None:
            self._counters["finished"] += 1
        else:
            seq.finish(FinishReason.ERROR)
        _emit(seq, seq.event((), "", error=f"{type(exc).__name__}: {exc}"))

    def _fail(self, batch: ScheduledBatch, exc: Exception, error_status: str | None = None) -> None:
        self._flush_text()  # the last step's events go out before these errors
        for seq in batch.seqs:
            if self.scheduler.remove(seq.request_id, FinishReason.ERROR) is not None:
                self._counters["finished"] += 1
                _emit(seq, seq.event((), "", error=f"{type(exc).__name__}: {exc}", error_status=error_status))

    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
        for seq in new:
            self._counters["prompt_tokens"] += len(seq.prompt_ids)
            self.scheduler.hash_prompt(seq)
            self.scheduler.mark_arrived(seq)
            if self.cold is None or not self.cold.start_prefix_load(seq):
                self.scheduler.add(seq)
        for request_id in cancels:
            self._cancel_one(request_id)

    def _cancel_one(self, request_id: RequestId) -> None:
        held = None if self.cold is None else self.cold.take_held(request_id)
        if held is not None:  # its prefix is still loading: it never reached a queue
            held.finish(FinishReason.CANCELLED)
            self.scheduler.enqueued_s.pop(request_id, None)
        seq = held or self.scheduler.remove(request_id, FinishReason.CANCELLED)
        if seq is not None:
            self._counters["finished"] += 1
            _emit(seq, seq.event((), ""))

    def _cancel_everything(self) -> None:
        self._ahead = None  # stopping: the prepared step never runs
        self._flush_text()
        self._drain_inbox()
        waiting = [s for q in self.scheduler.waiting.values() for s in q]
        held = [] if self.cold is None else self.cold.held()
        for seq in [*self.scheduler.running, *waiting, *held]:
            self._cancel_one(seq.request_id)

    # --- helpers ---------------------------------------------------------------------------------

    def _check_prompt(self, prompt_ids: Seq[int]) -> None:
        if not prompt_ids:
            raise EmptyPrompt("prompt has no tokens; send at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise PromptTooLong(len(prompt_ids), self.max_seq_len)
        vocab_size = self.config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidPrompt(f"prompt has token ids outside [0, {vocab_size}): {bad[:5]}")

    def _new_sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_event: EventCallback,
        tiers: TierConfig,
        cache_salt: str,
        intent_class: str,
    ) -> Sequence:
        seed = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        request_id = RequestId(uuid.uuid4().hex)
        detokenizer = self.tokenizer.detokenizer(prompt_ids)
        return Sequence(
            request_id, prompt_ids, params, on_event, detokenizer, seed, tiers, cache_salt, intent_class
        )


def _class_tiers(tiers: TierConfig, cls: IntentClass) -> TierConfig:
    """The deployment's tiers with the class's hot/warm sizes, where it sets them."""
    return dataclasses.replace(
        tiers,
        hot_tokens=tiers.hot_tokens if cls.hot_tokens is None else cls.hot_tokens,
        warm_tokens=tiers.warm_tokens if cls.warm_tokens is None else cls.warm_tokens,
        max_hot_tokens=tiers.max_hot_tokens if cls.max_hot_tokens is None else cls.max_hot_tokens,
    )


def _check_max_seq_len(config: ModelConfig, max_seq_len: int | None) -> int:
    """The positions the model is built for: the requested length, or the model's own limit."""
    limit = config.max_position_embeddings
    if max_seq_len is None:
        return limit
    if not 2 <= max_seq_len <= limit:
        raise ValueError(
            f"max_seq_len must be in [2, {limit}] (the model's max_position_embeddings), got {max_seq_len}"
        )
    return max_seq_len


def _plan_kv_pools(
    model: LlamaModel,
    kv: KVCacheSpec,
    classes: IntentClasses,
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
    max_batch_size: int,
    max_seq_len: int | None,
    max_prefill_tokens: int,
) -> PoolPlan:
    """Size the pools from the device's memory (CUDA) or the CPU setting, and settle max_seq_len.

    An unset max_seq_len becomes the model's own limit when one such sequence fits the budget, and
    the longest that fits otherwise; a set one that does not fit is refused with the numbers.
    """
    config = model.rank_config
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    explicit = kv.pools_set_by_hand
    if explicit:  # the deployment set both pools: they are the budget, and nothing is profiled
        budget = kv.num_hot_blocks * hot_block_bytes(config, kv.block_size, dtype_bytes)
        if kv.tiers.enabled:
            budget += kv.num_warm_groups * warm_group_bytes(config, kv.tiers.group_size)
        where = "THERMOCLINE_ENGINE_KV_HOT_BLOCKS / _KV_WARM_GROUPS"
    elif device.type == "cuda":
        budget = _gpu_kv_budget(model, kv, device, dtype, attention, max_batch_size, max_prefill_tokens)
        where = f"THERMOCLINE_ENGINE_GPU_MEMORY_UTILIZATION ({kv.gpu_memory_utilization})"
    else:
        budget = kv.cpu_cache_mb << 20
        where = f"THERMOCLINE_ENGINE_CPU_KV_CACHE_MB ({kv.cpu_cache_mb})"
    limit = config.max_position_embeddings
    fits = longest_fitting_seq_len(config, kv, budget, dtype_bytes, limit)
    if max_seq_len is not None and fits < max_seq_len and not explicit:
        per_token = hot_block_bytes(config, kv.block_size, dtype_bytes) / kv.block_size
        raise KVBudgetTooSmall(
            f"max_seq_len {max_seq_len} needs {format_bytes(max_seq_len * per_token)} of KV cache for one "
            f"sequence, but the KV budget is {format_bytes(max(budget, 0))} (longest that fits: {fits} "
            f"tokens); lower THERMOCLINE_ENGINE_MAX_SEQ_LEN, raise {where}, or turn the KV tiers on"
        )
    if fits < 2:
        raise KVBudgetTooSmall(
            f"the KV budget of {format_bytes(budget)} holds no sequence at all; raise {where}, "
            "or free device memory (a smaller model, a lower dtype, more tensor-parallel ranks)"
        )
    seq_len = max_seq_len if max_seq_len is not None else fits
    if seq_len < limit and max_seq_len is None:
        logger.warning("max_seq_len is %d, below the model's %d: the KV budget holds no more", fits, limit)
    class_tiers = [_class_tiers(kv.tiers, c) for c in classes.by_name.values()]
    return plan_pools(
        config, kv, class_tiers, budget, dtype_bytes, seq_len, max_batch_size, max_prefill_tokens,
        cap_at_need=device.type != "cuda" and not explicit,
    )  # fmt: skip


def warm_up_requests(vocab_size: int, chunk: int, max_seq_len: int) -> list[tuple[list[int], int]]:
    """`LLMEngine.warm_up`'s prompts (random ids, seeded) and the tokens each decodes: a short one that
    decodes beside the others' chunks, then two long ones whose last chunks fall under and over the
    dense path's 1,024 tokens; each cut to fit `max_seq_len` with its answer."""
    generator = torch.Generator().manual_seed(0)
    requests = []
    for length, new_tokens in ((40, 16), (2 * chunk + 300, 2), (chunk + 1500, 2)):
        size = max(1, min(length, max_seq_len - 16))
        prompt = torch.randint(2, vocab_size, (size,), generator=generator).tolist()
        requests.append((prompt, new_tokens))
    return requests


def _gpu_kv_budget(
    model: LlamaModel,
    kv: KVCacheSpec,
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
    max_batch_size: int,
    max_prefill_tokens: int,
) -> int:
    """`utilization * total` less what the weights, the CUDA context and the profiled activations use.

    Under tensor parallelism the profile would need every rank's collectives, so rank 0 estimates
    the activations instead: the largest prefill's MLP and attention buffers and the decode logits.
    """
    config, size = model.rank_config, torch.empty((), dtype=dtype).element_size()
    step_tokens = max_prefill_tokens + max_batch_size  # a mixed step: a whole chunk and a row per stream
    if not model.tp.is_parallel:
        profile = profile_memory(
            model, device, dtype, attention, kv.block_size, kv.tiers, step_tokens, max_batch_size,
            chunk_tokens=max_prefill_tokens,
        )  # fmt: skip
        total, used, activation = profile.total_bytes, profile.used_bytes, profile.activation_peak_bytes
    else:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        per_token = (2 * config.intermediate_size + 4 * config.hidden_size + 2 * config.q_size) * size
        activation = 2 * step_tokens * per_token + max_batch_size * config.vocab_size * 4
    reserve = GRAPH_AND_WORKSPACE_RESERVE_BYTES
    if kv.tiers.enabled and attention != "reference":  # the fused backend's warm-prefix pages
        reserve += prefix_page_bytes(config.num_kv_heads, config.head_dim, kv.block_size, size)
    if attention != "reference":  # the dense prefill path's gathered hot prefix and merge (not profiled)
        reserve += dense_prefill_bytes(
            max_prefill_tokens, config.num_heads, config.num_kv_heads, config.head_dim, size
        )
    budget = budget_from_device_memory(total, used, activation, kv.gpu_memory_utilization, reserve)
    logger.info(
        "KV budget %.2f GiB: %.0f%% of %.1f GiB, less %.2f GiB in use and a %.2f GiB activation peak",
        budget / GIB, 100 * kv.gpu_memory_utilization, total / GIB, used / GIB, activation / GIB,
    )  # fmt: skip
    return budget


def _build_kv_cache(
    config: ModelConfig, kv: KVCacheSpec, plan: PoolPlan, device: torch.device, dtype: torch.dtype
) -> KVCache:
    """The pools of `plan`; a warm tier only when the tiers are on."""
    kv.tiers.check_block_size(kv.block_size)
    hot = HotTier(config, plan.num_hot_blocks, kv.block_size, device, dtype)
    if not kv.tiers.enabled:
        return KVCache(hot, None)
    return KVCache(hot, WarmTier(config, plan.num_warm_groups, kv.tiers.group_size, device))


def _capped(params: SamplingParams, cls: IntentClass) -> SamplingParams:
    if cls.max_new_tokens and params.max_new_tokens > cls.max_new_tokens:
        return dataclasses.replace(params, max_new_tokens=cls.max_new_tokens)
    return params


def _timeout_message(item: ExpiredRequest) -> str:
    return (
        f"waited {item.waited_s:.1f} s in the queue of intent class {item.seq.intent_class!r} "
        f"(timeout {item.timeout_s:.1f} s, {item.num_ahead} request(s) ahead of it) without being admitted; "
        "retry later, try a less loaded replica, or raise the class's queue_timeout_s or reserved_slots"
    )


class PendingFetch:
    """Sampled ids `[B]` and gate flags `[B, C]` on their way to the host in one copy: one sync per step.

    The copy is queued at once; `wait` blocks on it alone, not on work queued after it (an
    overlapped next step)."""

    def __init__(self, token_ids: torch.Tensor, flags: torch.Tensor | None) -> None:
        self.num_categories = 0 if flags is None else flags.shape[1]
        values = token_ids if flags is None else torch.cat([token_ids, flags.flatten()])  # [B + B * C]
        self.num_rows = token_ids.shape[0]
        self.event: torch.cuda.Event | None = None
        if values.is_cuda:
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values

    def wait(self) -> tuple[list[int], list[list[int]]]:
        if self.event is not None:
            self.event.synchronize()
        values = self.values.tolist()
        ids, bits, width = values[: self.num_rows], values[self.num_rows :], self.num_categories
        return ids, [bits[r * width : (r + 1) * width] for r in range(self.num_rows)] if width else []


def _emit(seq: Sequence, event: StreamEvent) -> None:
    try:
        seq.on_event(event)
    except Exception:  # a broken callback must not stall other requests
        logger.exception("on_event callback failed for request %s", seq.request_id)
