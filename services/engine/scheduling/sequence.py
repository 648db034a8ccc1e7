"""One request's life in the engine: its tokens, its text stream, its timeline and why it ended."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NewType

from services.engine.gate.safety_gate import GatePolicy
from services.engine.kv.block_pool import BlockId
from services.engine.kv.block_table import BlockTable
from services.engine.kv.tiers import TierConfig
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.text.detokenizer import IncrementalDetokenizer
from services.engine.text.stop_checker import StopChecker

RequestId = NewType("RequestId", str)
# What OpenTelemetry accepts as an attribute value; kept here so the engine core imports no OTel.
AttributeValue = str | bool | int | float | Seq[str] | Seq[bool] | Seq[int] | Seq[float]


class FinishReason(enum.Enum):
    """Why a sequence stopped producing tokens."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_new_tokens or max_seq_len reached
    CANCELLED = "cancelled"  # the caller cancelled it
    ERROR = "error"  # the engine failed while running it
    SAFETY = "safety"  # reserved for the in-loop safety gate


class SequenceStatus(enum.Enum):
    """Where a sequence is in the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class StreamEvent:
    """What one engine step produced for one request; the last event has `finished=True`.

    Treat it as read-only. It is not frozen because one is built per row per step: a frozen
    dataclass sets each field through `object.__setattr__`, which at batch 256 cost the step a few
    hundred microseconds of host time (the device waits on it there)."""

    request_id: RequestId
    token_ids: tuple[int, ...]  # new token ids (empty for CANCELLED/ERROR events)
    text_delta: str  # new text; all deltas concatenate to the completion text
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # set with FinishReason.ERROR
    error_status: str | None = None  # deadline_exceeded / resource_exhausted (queue refusals), unavailable
    usage: SequenceUsage | None = None  # set on the final event
    timeline: Timeline | None = None  # set on the final event; the servicer turns it into spans


@dataclass(frozen=True)
class SequenceUsage:
    """Prefix-cache reuse and tokens attended per tier (mean per decode step) for one request."""

    cached_prompt_tokens: int
    hot_tokens: int
    warm_tokens: int
    cold_tokens: int = 0  # auxiliary-window tokens loaded back from the kvstore
    cold_prompt_tokens: int = 0  # of cached_prompt_tokens, those loaded from the kvstore


@dataclass(frozen=True)
class TimedEvent:
    """Something that happened to a request at one instant (preemption, demotion, safety gate)."""

    name: str
    time_ns: int  # wall clock, time.time_ns(): spans are exported with epoch timestamps
    attributes: Mapping[str, AttributeValue]


@dataclass(frozen=True)
class Interval:
    """A stretch of a request's life, wall clock in ns; `num_tokens` for prefill chunks."""

    start_ns: int
    end_ns: int
    num_tokens: int = 0


@dataclass
class Timeline:
    """When a request waited, prefilled, produced its first token and finished.

    Written only on the engine thread; read by the servicer after the final event, which crosses
    threads through the event loop, so no lock is needed. Recording is a `time.time_ns()` call and
    a list append: the decode loop stays free of syncs and of tracing objects.
    """

    arrival_ns: int = field(default_factory=time.time_ns)
    queue_waits: list[Interval] = field(default_factory=list)
    prefill_chunks: list[Interval] = field(default_factory=list)
    events: list[TimedEvent] = field(default_factory=list)
    first_token_ns: int | None = None
    finished_ns: int | None = None
    _queued_since_ns: int | None = None
    _chunk_start_ns: int | None = None

    def __post_init__(self) -> None:
        self._queued_since_ns = self.arrival_ns

    def mark_queued(self) -> None:
        """The request (re)enters a waiting queue: on arrival and after a preemption."""
        self._queued_since_ns = time.time_ns()

    def mark_admitted(self) -> None:
        """The scheduler admitted the request: closes the current queue wait."""
        if self._queued_since_ns is not None:
            self.queue_waits.append(Interval(self._queued_since_ns, time.time_ns()))
            self._queued_since_ns = None

    def begin_prefill_chunk(self) -> None:
        """A prefill step holding this request starts now."""
        self._chunk_start_ns = time.time_ns()

    def end_prefill_chunk(self, num_tokens: int) -> None:
        """The prefill step that began last has computed `num_tokens` of this request."""
        if self._chunk_start_ns is not None:
            self.prefill_chunks.append(Interval(self._chunk_start_ns, time.time_ns(), num_tokens))
            self._chunk_start_ns = None

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Record an instant event, stamped now."""
        self.events.append(TimedEvent(name, time.time_ns(), dict(attributes or {})))

    def mark_token(self) -> None:
        """A token was sampled: the first one stamps time to first token."""
        if self.first_token_ns is None:
            self.first_token_ns = time.time_ns()

    def mark_finished(self) -> None:
        """The request ended (any reason); the first call wins."""
        if self.finished_ns is None:
            self.finished_ns = time.time_ns()
            if self._queued_since_ns is not None:  # ended while waiting: the wait ends here
                self.queue_waits.append(Interval(self._queued_since_ns, self.finished_ns))
                self._queued_since_ns = None


EventCallback = Callable[[StreamEvent], None]


@dataclass(frozen=True)
class ColdPrefix:
    """Prompt blocks `[first_block, first_block + n)` of a prefix load and the hot blocks allocated
    for them, one each in order, in no request's table: the loader writes them while the load runs,
    and once its outcome came they hold what the kvstore gave back, waiting to be mapped."""

    first_block: int
    block_ids: tuple[BlockId, ...]

    @property
    def end_block(self) -> int:
        """One past the last block covered."""
        return self.first_block + len(self.block_ids)


class Sequence:
    """Mutable per-request state; touched only by the thread that runs engine steps."""

    def __init__(
        self,
        request_id: RequestId,
        prompt_ids: list[int],
        params: SamplingParams,
        on_event: EventCallback,
        detokenizer: IncrementalDetokenizer,
        seed: int | None,
        tiers: TierConfig | None = None,
        cache_salt: str = "",
        intent_class: str = "default",
        uses_aux_window: bool = False,
        trace_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.on_event = on_event
        self.completion_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table = BlockTable(tiers or TierConfig())
        self.num_computed_tokens = 0  # positions whose K/V are in the cache
        self.num_cached_prompt_tokens = 0  # prompt positions reused from the prefix cache
        self.cache_salt = cache_salt
        self.intent_class = intent_class
        self.num_preemptions = 0
        self._attended = [0, 0, 0, 0]  # decode steps, hot, warm and cold tokens attended
        self.uses_aux_window = uses_aux_window  # retrieval mode `semantic`: cold blocks come back by query
        self.gate_policy: GatePolicy | None = None  # the tenant's changes to the in-loop gate
        self.trace_metadata = trace_metadata  # the caller's trace context, sent on its kvstore calls
        self.cold_prefix: ColdPrefix | None = None  # prompt blocks loaded from the kvstore, not yet placed
        self.num_cold_prompt_tokens = 0  # prompt positions loaded from the kvstore instead of computed
        self.seed = seed  # the sampler's counter-based draws (None: greedy)
        self.timeline = Timeline()
        self._detokenizer = detokenizer
        self._stop_checker = StopChecker(params.stop)

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion length."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then completion."""
        return self.prompt_ids + self.completion_ids

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet: 1 when decoding, more while (re)prefilling."""
        return self.num_tokens - self.num_computed_tokens

    def record_attention(self, hot_tokens: int, warm_tokens: int, cold_tokens: int = 0) -> None:
        """Count one decode step's attended tokens per tier (for usage)."""
        self._attended[0] += 1
        self._attended[1] += hot_tokens
        self._attended[2] += warm_tokens
        self._attended[3] += cold_tokens

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Record an event on this request's trace (e.g. `thermocline.safety.triggered`), stamped now.

        Engine thread only; the servicer puts it on the request's engine span when the request ends.
        """
        self.timeline.add_event(name, attributes)

    def usage(self) -> SequenceUsage:
        """Usage so far: attended tokens are means per decode step."""
        steps = max(self._attended[0], 1)
        return SequenceUsage(
            self.num_cached_prompt_tokens,
            self._attended[1] // steps,
            self._attended[2] // steps,
            self._attended[3] // steps,
            self.num_cold_prompt_tokens,
        )

    @property
    def last_token_id(self) -> int:
        """The token the next decode step feeds in."""
        return self.completion_ids[-1] if self.completion_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is SequenceStatus.FINISHED

    def ends_by_length_after_one(self, max_seq_len: int) -> bool:
        """True when the token being sampled now will end the sequence by length."""
        num_new = len(self.completion_ids) + 1
        return num_new >= self.params.max_new_tokens or self.num_tokens + 1 >= max_seq_len

    def append_token_id(self, token_id: int, eos_token_ids: frozenset[int], max_seq_len: int) -> None:
        """Record a sampled token's id, and finish on EOS or length (the host-cheap half of a token).

        The engine runs this before the next step starts and `text_event` while that step runs on
        the device, so detokenization and stop strings stay off the step's critical path.
        """
        self.completion_ids.append(token_id)
        self.timeline.mark_token()
        if token_id in eos_token_ids and not self.params.ignore_eos:
            self.finish(FinishReason.STOP)
        elif len(self.completion_ids) >= self.params.max_new_tokens or self.num_tokens >= max_seq_len:
            self.finish(FinishReason.LENGTH)

    def text_event(self, token_id: int) -> StreamEvent:
        """The text `token_id` adds (appended by `append_token_id`), as this token's event.

        A stop string ends the sequence here (STOP wins over a LENGTH set by the same token). When
        the sequence has ended, the event also carries every character still held back.
        """
        text = self._detokenizer.push(token_id)
        if self._stop_checker.is_active:
            text, is_stopped = self._stop_checker.push(text)
            if is_stopped:
                self.finish(FinishReason.STOP)
                return self.event((token_id,), text)
        if self.status is SequenceStatus.FINISHED:
            text += self._drain_text()
        return self.event((token_id,), text)

    def _drain_text(self) -> str:
        # end of stream: release text held back for an unfinished character or a partial stop string
        tail = self._stop_checker.push(self._detokenizer.flush())
        return tail.text + self._stop_checker.flush()

    def finish(self, reason: FinishReason) -> None:
        """Mark the sequence done (the scheduler frees its slot)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.timeline.mark_finished()

    def event(
        self, token_ids: tuple[int, ...], text: str, error: str | None = None, error_status: str | None = None
    ) -> StreamEvent:
        """A StreamEvent carrying the sequence's current counts and status."""
        return StreamEvent(
            request_id=self.request_id,
            token_ids=token_ids,
            text_delta=text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.completion_ids),
            error=error,
            error_status=error_status,
            usage=self.usage() if self.is_finished else None,
            timeline=self.timeline if self.is_finished else None,
        )
