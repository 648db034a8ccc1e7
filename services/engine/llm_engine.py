"""The engine: accepts requests from any thread and runs batched prefill/decode steps on one thread."""

from __future__ import annotations

import logging
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from services.engine.checkpoint import open_checkpoint
from services.engine.errors import EmptyPrompt, EngineStopped, InvalidPrompt, PromptTooLong
from services.engine.generation_result import GenerationResult, ResultCollector
from services.engine.kv_cache import ContiguousKVCache
from services.engine.model_config import ModelConfig
from services.engine.model_loader import load_model, resolve_device, resolve_dtype
from services.engine.model_runner import ModelRunner
from services.engine.models import resolve_model
from services.engine.sampler import make_generator, sample
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledBatch, Scheduler, StepKind
from services.engine.sequence import EventCallback, FinishReason, RequestId, Sequence, StreamEvent
from services.engine.tokenizer import Tokenizer

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

DEFAULT_MAX_SEQ_LEN = 2048  # cap when the caller gives none: the contiguous cache reserves it per slot
DEFAULT_MAX_PREFILL_TOKENS = 4096  # padded prompt tokens per prefill step


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


class LLMEngine:
    """Continuous-batching generation over one model on one device."""

    def __init__(
        self,
        model_id: str,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    ) -> None:
        self.model_id = model_id
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.scheduler = Scheduler(runner.kv_cache, max_prefill_tokens)
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._lock = threading.Condition()
        self._step_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._cancels: deque[RequestId] = deque()
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._counters = dict.fromkeys(("steps", "prompt_tokens", "generated_tokens", "finished"), 0)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 16,
        max_seq_len: int | None = None,
        progress: bool = True,
    ) -> LLMEngine:
        """Load an HF directory, a `.gguf` file or a registered model name."""
        checkpoint = open_checkpoint(resolve_model(path))
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        seq_len = _resolve_max_seq_len(checkpoint.config, max_seq_len)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model = load_model(checkpoint, torch_device, torch_dtype, seq_len, progress)
        cache = ContiguousKVCache(checkpoint.config, max_batch_size, seq_len, torch_device, torch_dtype)
        runner = ModelRunner(model, cache, torch_device)
        return cls(checkpoint.model_id, runner, checkpoint.tokenizer, max_batch_size, seq_len)

    @property
    def config(self) -> ModelConfig:
        """The model's architecture."""
        return self.runner.model.config

    # --- thread-safe API -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: EventCallback) -> RequestHandle:
        """Queue a request; `on_event` is then called on the engine thread for each step's output."""
        if self._is_stopping:
            raise EngineStopped("the engine is stopped; it accepts no new requests")
        self._check_prompt(prompt_ids)
        seq = self._new_sequence(list(prompt_ids), params, on_event)
        with self._lock:
            self._inbox.append(seq)
            self._lock.notify()
        return RequestHandle(seq.request_id)

    def cancel(self, handle_or_request_id: RequestHandle | RequestId | str) -> None:
        """Cancel a request: slot freed before the next step, final CANCELLED event; unknown ids ignored."""
        request_id = getattr(handle_or_request_id, "request_id", handle_or_request_id)
        with self._lock:
            self._cancels.append(RequestId(str(request_id)))
            self._lock.notify()

    def stats(self) -> EngineStats:
        """Current load and lifetime counters."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_free_slots=self.runner.kv_cache.num_free_slots(),
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            num_steps=self._counters["steps"],
            num_prompt_tokens_total=self._counters["prompt_tokens"],
            num_generated_tokens_total=self._counters["generated_tokens"],
            num_requests_finished=self._counters["finished"],
        )

    def start(self) -> None:
        """Start the background step thread (idempotent)."""
        if self._thread is not None:
            return
        self._is_stopping = False
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
                while not (self._is_stopping or self._inbox or self._cancels or self.scheduler.has_work):
                    self._lock.wait()
                if self._is_stopping:
                    return
            try:
                self.step()
            except Exception:  # keep serving; step() already fails the requests it could not run
                logger.exception("engine loop error")

    def step(self) -> None:
        """Take in new requests and cancels, then run one prefill or decode step and emit its events."""
        with self._step_lock:
            self._drain_inbox()
            batch = self.scheduler.schedule()
            if batch is None:
                return
            try:
                token_ids = self._run(batch)
            except Exception as exc:  # a failed step must not take the engine down
                logger.exception("engine step failed; failing %d request(s)", len(batch.seqs))
                self._fail(batch, exc)
                return
            self._counters["steps"] += 1
            self._commit(batch, token_ids)

    def _run(self, batch: ScheduledBatch) -> list[int]:
        is_prefill = batch.kind is StepKind.PREFILL
        output = self.runner.prefill(batch.seqs) if is_prefill else self.runner.decode(batch.seqs)
        params = [s.params for s in batch.seqs]
        generators = [s.generator for s in batch.seqs]
        return sample(output.logits, params, generators).tolist()  # the step's one host sync

    def _commit(self, batch: ScheduledBatch, token_ids: list[int]) -> None:
        for seq, token_id in zip(batch.seqs, token_ids, strict=True):
            event = seq.append_token(token_id, self._eos_token_ids, self.max_seq_len)
            self._counters["generated_tokens"] += 1
            if seq.is_finished:
                self.scheduler.release(seq)
                self._counters["finished"] += 1
            _emit(seq, event)

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> None:
        for seq in batch.seqs:
            if self.scheduler.remove(seq.request_id, FinishReason.ERROR) is not None:
                self._counters["finished"] += 1
                _emit(seq, seq.event((), "", error=f"{type(exc).__name__}: {exc}"))

    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
        for seq in new:
            self.scheduler.add(seq)
            self._counters["prompt_tokens"] += len(seq.prompt_ids)
        for request_id in cancels:
            self._cancel_one(request_id)

    def _cancel_one(self, request_id: RequestId) -> None:
        seq = self.scheduler.remove(request_id, FinishReason.CANCELLED)
        if seq is not None:
            self._counters["finished"] += 1
            _emit(seq, seq.event((), ""))

    def _cancel_everything(self) -> None:
        self._drain_inbox()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
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
        self, prompt_ids: list[int], params: SamplingParams, on_event: EventCallback
    ) -> Sequence:
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator = make_generator(seed, self.runner.device)
        request_id = RequestId(uuid.uuid4().hex)
        detokenizer = self.tokenizer.detokenizer(prompt_ids)
        return Sequence(request_id, prompt_ids, params, on_event, detokenizer, generator)


def _resolve_max_seq_len(config: ModelConfig, max_seq_len: int | None) -> int:
    if max_seq_len is None:
        return min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if not 2 <= max_seq_len <= config.max_position_embeddings:
        raise ValueError(
            f"max_seq_len must be in [2, {config.max_position_embeddings}] (the model's "
            f"max_position_embeddings), got {max_seq_len}"
        )
    return max_seq_len


def _emit(seq: Sequence, event: StreamEvent) -> None:
    try:
        seq.on_event(event)
    except Exception:  # a broken callback must not stall other requests
        logger.exception("on_event callback failed for request %s", seq.request_id)
