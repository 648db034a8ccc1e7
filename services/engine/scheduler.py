"""Continuous batching: admit waiting requests between decode steps, keep running ones in dense slots."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from services.engine.kv_cache import KVCache
from services.engine.sequence import FinishReason, RequestId, Sequence, SequenceStatus


class StepKind(enum.Enum):
    """What a scheduled step runs."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledBatch:
    """Sequences for one forward step; they occupy consecutive cache slots starting at `slot_start`."""

    kind: StepKind
    seqs: tuple[Sequence, ...]

    @property
    def slot_start(self) -> int:
        """Cache slot of the first row."""
        return self.seqs[0].slot


class Scheduler:
    """Owns the waiting queue and the running list; `running[i].slot == i` always holds.

    Prefill comes first (new requests join as soon as there is a free slot, which keeps time to
    first token low); otherwise every running sequence decodes one token together.
    """

    def __init__(self, kv_cache: KVCache, max_prefill_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for prefill."""
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when idle."""
        admitted = self._admit()
        if admitted:
            return ScheduledBatch(StepKind.PREFILL, admitted)
        if self.running:
            return ScheduledBatch(StepKind.DECODE, tuple(self.running))
        return None

    def _admit(self) -> tuple[Sequence, ...]:
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and self.kv_cache.num_free_slots() > 0:
            candidate = self.waiting[0]
            longest_if_added = max(longest, len(candidate.prompt_ids))
            padded_tokens = longest_if_added * (len(admitted) + 1)
            if admitted and padded_tokens > self.max_prefill_tokens:
                break
            admitted.append(self._start(self.waiting.popleft()))
            longest = longest_if_added
        return tuple(admitted)

    def _start(self, seq: Sequence) -> Sequence:
        seq.slot = self.kv_cache.allocate()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's slot, moving the last running sequence into it."""
        if seq.slot < 0:
            return
        move = self.kv_cache.free(seq.slot)
        last = self.running.pop()
        if move is not None:
            last.slot = move.to_slot
            self.running[move.to_slot] = last
        seq.slot = -1

    def remove(self, request_id: RequestId, reason: FinishReason) -> Sequence | None:
        """Finish and drop a request wherever it is (cancel); None when it is unknown or done."""
        seq = self._find(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish(reason)
        self.release(seq)
        return seq

    def _find(self, request_id: RequestId) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
