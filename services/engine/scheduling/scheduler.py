"""Continuous batching with chunked prefill, intent classes, prefix reuse and preemption by recompute."""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from services.engine.execution.model_runner import ScheduledRow
from services.engine.kv.block_pool import hash_prefix_blocks
from services.engine.kv.cache import DemotionResult, KVCache
from services.engine.metrics import BATCH_SIZE
from services.engine.scheduling.cold_planner import ColdPlanner
from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from services.engine.scheduling.sequence import FinishReason, RequestId, Sequence, SequenceStatus

Clock = Callable[[], float]


class StepKind(enum.Enum):
    """What a scheduled step runs."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledBatch:
    """Rows for one forward step."""

    kind: StepKind
    rows: tuple[ScheduledRow, ...]
    # a prefill step's leading rows that decode one token alongside its prompt chunks (a mixed step)
    num_decode_rows: int = 0

    @property
    def seqs(self) -> tuple[Sequence, ...]:
        """The rows' sequences."""
        return tuple(r.seq for r in self.rows)


@dataclass(frozen=True)
class ExpiredRequest:
    """A request that waited past its class's queue timeout."""

    seq: Sequence
    waited_s: float
    timeout_s: float
    num_ahead: int  # requests of its class that arrived before it and still wait


class Scheduler:
    """Owns one waiting queue per intent class and the running list.

    Every running sequence past its prompt decodes one token a step. With `mixed_steps` (the
    default) those decode rows come first in every step, and prompt chunks of up to
    `max_prefill_tokens` tokens follow them (chunks of long prompts continue, then new requests join
    by class priority, within batch shares and other classes' reserved slots): a long prompt stalls
    the running streams for one chunk's step at a time, not for its whole prefill. A step then holds
    up to `max_prefill_tokens + max_batch_size` tokens. Without it, prefill steps come first and
    decoding waits until no prompt is left to compute.

    Inside a class, a free slot goes to the first-arrived request of the tenant (its `cache_salt`,
    which the gateway sets to the tenant) running the fewest sequences of that class, not to the
    head of the queue: one tenant's backlog cannot hold another tenant's request behind all of it.
    Classes keep their own priority, share and reservations, so this only orders tenants within one.

    When hot blocks run out, the lowest-priority running sequence is preempted by recompute: its
    blocks are freed and it waits again at the head of its queue (counted in `num_preemptions`; its
    stream continues once it is re-run).
    """

    def __init__(
        self,
        kv_cache: KVCache,
        max_batch_size: int,
        max_prefill_tokens: int,
        classes: IntentClasses | None = None,
        model_id: str = "",
        clock: Clock = time.monotonic,
        mixed_steps: bool = True,
    ) -> None:
        self.kv_cache = kv_cache
        self.mixed_steps = mixed_steps
        self._block_size = kv_cache.block_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.classes = classes or IntentClasses.builtin()
        self.classes.check_fits(max_batch_size)
        self._classes_by_priority = sorted(self.classes.by_name.values(), key=lambda c: -c.priority)
        self.model_id = model_id
        self.clock = clock
        self.waiting: dict[str, deque[Sequence]] = {name: deque() for name in self.classes.by_name}
        self.running: list[Sequence] = []
        self.enqueued_s: dict[RequestId, float] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens_cached = 0
        self.num_prompt_tokens_queried = 0
        self.num_dropped_tokens_last_step = 0
        self.num_prefill_tokens_computed = 0  # prompt (and recomputed) tokens run through the model
        self.cold: ColdPlanner | None = None  # the kvstore tier, when the engine has one
        self._queue_waits: list[tuple[str, float]] = []

    @property
    def num_waiting(self) -> int:
        """Sequences in all queues."""
        return sum(len(q) for q in self.waiting.values())

    @property
    def has_work(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (its class must be known)."""
        self.classes.get(seq.intent_class)
        self.waiting[seq.intent_class].append(seq)
        self.enqueued_s.setdefault(seq.request_id, self.clock())
        self.hash_prompt(seq)

    def hash_prompt(self, seq: Sequence) -> None:
        """The chained content hashes of the prompt's full blocks (once per sequence)."""
        if not seq.block_table.prefix_hashes:
            seq.block_table.prefix_hashes = hash_prefix_blocks(
                seq.prompt_ids, self.kv_cache.block_size, self.model_id, seq.cache_salt
            )

    def mark_arrived(self, seq: Sequence) -> None:
        """Start a new sequence's queue wait before it reaches a queue (a prefix load counts as waiting)."""
        self.enqueued_s[seq.request_id] = self.clock()

    # --- scheduling ----------------------------------------------------------------------------

    def schedule(self, ending: Collection[int] = ()) -> ScheduledBatch | None:
        """The next step's rows, or None when idle.

        `ending`: ids of running sequences whose token in flight ends them; they get no decode row.
        """
        # the decode rows come on top of the prompt chunks' budget: a chunk's length does not depend on
        # how many streams run (a new length would cost the dense prefill path new kernel plans)
        decode = self._decode_rows(ending, mid_prompt=False) if self.mixed_steps else []
        prefill, no_room = self._continue_prefills()
        prefill += self._admit(prefill)
        if self.mixed_steps:  # a prompt whose chunk finds no blocks goes on a token a step, as without
            decode += [ScheduledRow(seq, 1) for seq in no_room if self._reserve(seq, 1)]
        running = SequenceStatus.RUNNING  # a later row's reservation may have preempted an earlier one
        decode = [r for r in decode if r.seq.status is running]
        prefill = [r for r in prefill if r.seq.status is running]
        if prefill:
            for row in prefill:
                row.seq.timeline.begin_prefill_chunk()
            BATCH_SIZE.labels(StepKind.PREFILL.value).observe(len(prefill))
            if decode:
                BATCH_SIZE.labels(StepKind.DECODE.value).observe(len(decode))
            return ScheduledBatch(StepKind.PREFILL, tuple(decode + prefill), len(decode))
        if not self.mixed_steps:
            decode = self._decode_rows(ending)
        if not decode:
            return None
        BATCH_SIZE.labels(StepKind.DECODE.value).observe(len(decode))
        return ScheduledBatch(StepKind.DECODE, tuple(decode))

    def _budget_allows(self, rows: list[ScheduledRow], num_new: int) -> bool:
        width = max([num_new, *(r.num_new for r in rows)])
        return not rows or width * (len(rows) + 1) <= self.max_prefill_tokens

    def _chunk(self, seq: Sequence) -> int:
        return min(seq.num_pending_tokens, self.max_prefill_tokens)

    def _continue_prefills(self) -> tuple[list[ScheduledRow], list[Sequence]]:
        """The next chunk of each prompt under way that the budget allows; and the prompts whose chunk
        found no room in the hot pool (nothing lower to preempt)."""
        rows: list[ScheduledRow] = []
        no_room: list[Sequence] = []
        for seq in list(self.running):
            if seq.num_pending_tokens > 1 and seq.status is SequenceStatus.RUNNING:
                chunk = self._chunk(seq)
                if not self._budget_allows(rows, chunk):
                    continue
                if self._reserve(seq, chunk):
                    rows.append(ScheduledRow(seq, chunk))
                else:
                    no_room.append(seq)
        return rows, no_room

    def _admit(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        admitted: list[ScheduledRow] = []
        for cls in self._classes_by_priority:
            queue = self.waiting[cls.name]
            if not queue:
                continue
            running_by_tenant = self._running_by_tenant(cls.name)
            while queue and self._class_may_start(cls):
                position = _next_to_admit(queue, running_by_tenant)
                seq = queue[position]
                self._apply_prefix_cache(seq)
                chunk = self._chunk(seq)
                if not self._budget_allows(rows + admitted, chunk) or not self._reserve(
                    seq, chunk, is_admission=True
                ):
                    self._undo_prefix_cache(seq)
                    return admitted
                del queue[position]
                self._start(seq)
                running_by_tenant[seq.cache_salt] += 1
                admitted.append(ScheduledRow(seq, chunk))
        return admitted

    def _running_by_tenant(self, name: str) -> Counter[str]:
        """Running sequences of class `name` per tenant (the gateway's tenant is the cache salt)."""
        return Counter(s.cache_salt for s in self.running if s.intent_class == name)

    def _class_may_start(self, cls: IntentClass) -> bool:
        """Room in the batch, in the class's share, and outside other classes' unfilled reservations."""
        if len(self.running) >= self.max_batch_size:
            return False
        if self._num_running(cls.name) >= cls.max_running(self.max_batch_size):
            return False
        held_for_others = sum(
            max(0, c.reserved_slots - self._num_running(c.name))
            for c in self.classes.by_name.values()
            if c.name != cls.name
        )
        return self.max_batch_size - len(self.running) - 1 >= held_for_others

    def _num_running(self, name: str) -> int:
        return sum(1 for s in self.running if s.intent_class == name)

    def _apply_prefix_cache(self, seq: Sequence) -> None:
        """Reuse cached blocks of the prompt; the last prompt token is always recomputed for its logits."""
        if seq.num_computed_tokens or seq.completion_ids:
            return
        pool = self.kv_cache.hot.pool
        max_blocks = (len(seq.prompt_ids) - 1) // self.kv_cache.block_size
        hits = pool.lookup(seq.block_table.prefix_hashes[:max_blocks])
        pool.share(hits)
        seq.block_table.hot_block_ids = list(hits)
        loaded = 0 if self.cold is None else self.cold.attach_prefix(seq, len(hits), max_blocks)
        seq.block_table.num_registered_blocks = len(hits) + loaded
        seq.num_computed_tokens = (len(hits) + loaded) * self.kv_cache.block_size
        seq.num_cold_prompt_tokens = loaded * self.kv_cache.block_size

    def _undo_prefix_cache(self, seq: Sequence) -> None:
        self.kv_cache.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_cold_prompt_tokens = 0

    def _reserve(self, seq: Sequence, num_new: int, is_admission: bool = False) -> bool:
        """Make the table cover the step's tokens, preempting lower-priority sequences if needed.

        A new request may only preempt strictly lower classes; running work may also preempt the
        latest-started sequence of its own class (so the batch shrinks instead of failing).
        """
        num_tokens = seq.num_computed_tokens + num_new
        table = seq.block_table
        if len(table.hot_block_ids) * self._block_size >= num_tokens:  # most decode steps: room already
            return True
        while not self.kv_cache.can_grow(table, num_tokens):
            own = self.classes.get(seq.intent_class).priority - (1 if is_admission else 0)
            victim = self._preemption_victim(own, exclude=seq)
            if victim is None:
                return False
            self.preempt(victim)
        self.kv_cache.grow(table, num_tokens)
        return True

    def _preemption_victim(self, priority: int, exclude: Sequence) -> Sequence | None:
        """The lowest-priority, latest-started running sequence at or below `priority`."""
        candidates = [s for s in self.running if s is not exclude]
        candidates = [s for s in candidates if self.classes.get(s.intent_class).priority <= priority]
        if not candidates:
            return None
        return min(reversed(candidates), key=lambda s: self.classes.get(s.intent_class).priority)

    def preempt(self, seq: Sequence) -> None:
        """Free all of a running sequence's blocks; it recomputes its tokens when re-admitted."""
        self.kv_cache.release(seq.block_table)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.add_event(
            "thermocline.preemption",
            {"thermocline.preemption.mode": "recompute", "thermocline.preemption.count": seq.num_preemptions},
        )
        seq.timeline.mark_queued()
        self.waiting[seq.intent_class].appendleft(seq)

    def _start(self, seq: Sequence) -> None:
        if seq.num_preemptions == 0:
            self.num_prompt_tokens_queried += len(seq.prompt_ids)
            self.num_prompt_tokens_cached += seq.num_computed_tokens
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
        if self.cold is not None:
            self.cold.on_started(seq)
        seq.status = SequenceStatus.RUNNING
        seq.timeline.mark_admitted()
        enqueued = self.enqueued_s.pop(seq.request_id, None)
        if enqueued is not None:
            self._queue_waits.append((seq.intent_class, self.clock() - enqueued))
        self.running.append(seq)

    def _decode_rows(self, ending: Collection[int], mid_prompt: bool = True) -> list[ScheduledRow]:
        """One token for each running sequence (highest class first); `mid_prompt`: for sequences
        still inside their prompt too (prompts first: a chunk that found no room goes a token a
        step), else only for those past it."""
        rows: list[ScheduledRow] = []
        running = [s for s in self.running if id(s) not in ending]  # a copy: reserving may preempt
        if len({s.intent_class for s in running}) > 1:  # highest priority first (a stable sort)
            running = sorted(running, key=lambda s: -self.classes.get(s.intent_class).priority)
        for seq in running:
            if not mid_prompt and seq.num_pending_tokens > 1:  # 0 pending: its token is in flight
                continue
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1):
                rows.append(ScheduledRow(seq, 1))
        return [r for r in rows if r.seq.status is SequenceStatus.RUNNING]

    # --- after a step --------------------------------------------------------------------------

    def commit_computed(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance each row past its computed tokens, publish full prompt blocks, demote to warm.

        Returns the sequences whose pending tokens are all computed (they get a sampled token).
        """
        done: list[Sequence] = []
        self.num_dropped_tokens_last_step = 0
        # rows from here on are prompt chunks (a mixed step's decode rows come first)
        first_prefill = batch.num_decode_rows if batch.kind is StepKind.PREFILL else len(batch.rows)
        finished = SequenceStatus.FINISHED
        cache, cold = self.kv_cache, self.cold
        for i, (seq, num_new) in enumerate(batch.rows):  # per row per step: at batch 256 the device waits
            if seq.status is finished:  # a dead row: ended after the step was prepared; its blocks are free
                continue
            seq.num_computed_tokens += num_new
            if i >= first_prefill:
                seq.timeline.end_prefill_chunk(num_new)
                self.num_prefill_tokens_computed += num_new
            table = seq.block_table
            if table.num_registered_blocks < len(table.prefix_hashes):  # the prompt's blocks: until all are
                registered = cache.register_full_blocks(table, seq.num_computed_tokens)
                if cold is not None:  # before demotion maps the blocks it frees to the scratch block
                    cold.store_prefix(seq, registered)
            if table.tiers.enabled:
                demoted = cache.demote(table, seq.num_computed_tokens)
                if cold is not None:
                    cold.demote(seq, demoted.to_cold)
                if demoted.num_demoted_tokens or demoted.num_dropped_tokens:
                    self.num_dropped_tokens_last_step += demoted.num_dropped_tokens
                    _record_demotion(seq, demoted)
            if seq.num_pending_tokens == 0:
                done.append(seq)
        return done

    def take_queue_waits(self) -> list[tuple[str, float]]:
        """(intent class, seconds waited) of each sequence admitted since the last call."""
        waits, self._queue_waits = self._queue_waits, []
        return waits

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks at once (and its cold blocks, in the background)."""
        if self.cold is not None:
            self.cold.release(seq)
        self.kv_cache.release(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
            return
        # preempted while the token that ends it was in flight (its step was prepared ahead): it sits
        # in a waiting queue, and must not be admitted again
        queue = self.waiting[seq.intent_class]
        if any(waiting is seq for waiting in queue):
            queue.remove(seq)
            self.enqueued_s.pop(seq.request_id, None)

    def remove(self, request_id: RequestId, reason: FinishReason) -> Sequence | None:
        """Finish and drop a request wherever it is (cancel); None when it is unknown or done."""
        seq = self._find(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting[seq.intent_class].remove(seq)
            self.enqueued_s.pop(seq.request_id, None)
        seq.finish(reason)
        self.release(seq)
        return seq

    def expire(self) -> list[ExpiredRequest]:
        """Take out waiting requests past their class's queue timeout (never preempted ones)."""
        now = self.clock()
        expired: list[ExpiredRequest] = []
        for name, queue in self.waiting.items():
            timeout = self.classes.get(name).queue_timeout_s
            for position, seq in enumerate(list(queue)):
                waited = now - self.enqueued_s.get(seq.request_id, now)
                if seq.num_preemptions == 0 and waited > timeout:
                    expired.append(ExpiredRequest(seq, waited, timeout, position))
            for item in expired:
                if item.seq in queue:
                    queue.remove(item.seq)
                    self.enqueued_s.pop(item.seq.request_id, None)
        return expired

    def seconds_to_next_expiry(self) -> float | None:
        """Time until the first waiting request passes its class's queue timeout (None: none can)."""
        deadlines = [
            self.enqueued_s[seq.request_id] + self.classes.get(name).queue_timeout_s
            for name, queue in self.waiting.items()
            for seq in queue
            if seq.num_preemptions == 0 and seq.request_id in self.enqueued_s
        ]
        return max(0.0, min(deadlines) - self.clock()) if deadlines else None

    def _find(self, request_id: RequestId) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for queue in self.waiting.values():
            for seq in queue:
                if seq.request_id == request_id:
                    return seq
        return None


def _next_to_admit(queue: deque[Sequence], running_by_tenant: Counter[str]) -> int:
    """Position in a class's queue of the sequence to admit next: a preempted one at the head keeps
    its place; otherwise the first to arrive of the tenants running the fewest of the class.

    One pass over the queue, cut short by a tenant that runs none: a tenant's backlog costs the scan,
    never another tenant its turn.
    """
    if queue[0].num_preemptions:  # preempted sequences wait at the head, ahead of every new one
        return 0
    best, fewest = 0, running_by_tenant[queue[0].cache_salt]
    for position, seq in enumerate(queue):
        if fewest == 0:
            break
        num_running = running_by_tenant[seq.cache_salt]
        if num_running < fewest:
            best, fewest = position, num_running
    return best


def _record_demotion(seq: Sequence, demoted: DemotionResult) -> None:
    """A trace event per step that moved this sequence's tokens hot -> warm (or dropped warm ones)."""
    seq.add_event(
        "thermocline.kv.demotion",
        {
            "thermocline.kv.from_tier": "hot",
            "thermocline.kv.to_tier": "warm",
            "thermocline.kv.demoted_tokens": demoted.num_demoted_tokens,
            "thermocline.kv.dropped_tokens": demoted.num_dropped_tokens,
            "thermocline.kv.cold_tokens": len(demoted.to_cold) * seq.block_table.tiers.group_size,
        },
    )
