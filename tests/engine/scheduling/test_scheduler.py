"""Scheduler on a 1-head, head-dim-2 fake cache: chunked prefill, prefix reuse, classes, preemption."""

from __future__ import annotations

import itertools

from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.scheduler import ScheduledBatch, Scheduler, StepKind
from services.engine.scheduling.sequence import FinishReason, RequestId, Sequence, SequenceStatus
from services.engine.text.detokenizer import IncrementalDetokenizer
from tests.engine.fake_clock import FakeClock
from tests.engine.paged_helpers import ONE_HEAD, make_cache

BLOCK = 4


def _seq(
    name: str, num_tokens: int, intent_class: str = "standard", salt: str = "", first: int = 1
) -> Sequence:
    detokenizer = IncrementalDetokenizer(lambda ids: "", [1])
    prompt = list(range(first, first + num_tokens))
    seq = Sequence(RequestId(name), prompt, SamplingParams(), lambda e: None, detokenizer, None)
    seq.intent_class = intent_class
    seq.cache_salt = salt
    return seq


def _scheduler(
    num_blocks: int = 64,
    max_batch_size: int = 3,
    max_prefill_tokens: int = 100,
    classes: IntentClasses | None = None,
    clock: FakeClock | None = None,
    mixed_steps: bool = True,
) -> Scheduler:
    cache = make_cache(ONE_HEAD, num_blocks, BLOCK)
    return Scheduler(
        cache, max_batch_size, max_prefill_tokens, classes, "fake-model", clock or FakeClock(), mixed_steps
    )


def _run(scheduler: Scheduler) -> ScheduledBatch:
    """Schedule one step and pretend the model ran it: computed tokens advance, done rows get token 7."""
    batch = scheduler.schedule()
    assert batch is not None
    for seq in scheduler.commit_computed(batch):
        seq.completion_ids.append(7)
    return batch


def _names(batch: ScheduledBatch) -> list[str]:
    return [s.request_id for s in batch.seqs]


def _rows(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """(request, tokens) of every row, in the step's order."""
    return [(r.seq.request_id, r.num_new) for r in batch.rows]


def _chunks(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """The step's prompt chunks: (request, tokens), after a mixed step's decode rows."""
    return [(r.seq.request_id, r.num_new) for r in batch.rows[batch.num_decode_rows :]]


def test_without_mixed_steps_prefill_comes_first_and_respects_the_padded_token_budget() -> None:
    scheduler = _scheduler(max_prefill_tokens=30, mixed_steps=False)
    for i, (name, length) in enumerate((("a", 10), ("b", 12), ("c", 40))):
        scheduler.add(_seq(name, length, first=100 * i))  # distinct prompts: no prefix reuse
    first = _run(scheduler)
    assert first.kind is StepKind.PREFILL and _names(first) == ["a", "b"]  # 2 x 12 fit, 3 x 30 do not
    second = _run(scheduler)
    assert _names(second) == ["c"] and second.rows[0].num_new == 30  # chunked: 30 of 40 tokens
    third = _run(scheduler)
    assert third.kind is StepKind.PREFILL and third.rows[0].num_new == 10  # the rest of c's prompt
    fourth = _run(scheduler)
    assert fourth.kind is StepKind.DECODE and len(fourth.rows) == 3


def test_running_streams_decode_beside_prompt_chunks() -> None:
    scheduler = _scheduler(max_prefill_tokens=30)
    for i, (name, length) in enumerate((("a", 10), ("b", 12), ("c", 40))):
        scheduler.add(_seq(name, length, first=100 * i))
    first = _run(scheduler)
    assert first.num_decode_rows == 0 and _chunks(first) == [("a", 10), ("b", 12)]
    # a and b decode first; c's chunk still takes the whole budget (its length never depends on how
    # many streams decode beside it)
    second = _run(scheduler)
    assert second.kind is StepKind.PREFILL and second.num_decode_rows == 2
    assert _names(second)[:2] == ["a", "b"] and _chunks(second) == [("c", 30)]
    assert all(row.num_new == 1 for row in second.rows[:2])
    third = _run(scheduler)
    assert third.num_decode_rows == 2 and _chunks(third) == [("c", 10)]  # the rest of c's prompt
    fourth = _run(scheduler)
    assert fourth.kind is StepKind.DECODE and len(fourth.rows) == 3
    a, b, c = scheduler.running
    assert (len(a.completion_ids), len(b.completion_ids), len(c.completion_ids)) == (4, 4, 2)


def test_a_second_identical_request_reuses_blocks_and_skips_their_prefill() -> None:
    scheduler = _scheduler()
    pool = scheduler.kv_cache.hot.pool
    scheduler.add(_seq("a", 10))
    first = _run(scheduler)
    assert first.rows[0].num_new == 10
    scheduler.add(_seq("b", 10))
    second = _run(scheduler)
    a, b = scheduler.running
    assert _chunks(second) == [("b", 2)]  # 2 full blocks (8 tokens) reused; only 2 tokens computed
    assert b.num_cached_prompt_tokens == 8 and scheduler.num_prompt_tokens_cached == 8
    assert b.block_table.hot_block_ids[:2] == a.block_table.hot_block_ids[:2]
    assert [pool.blocks[i].ref_count for i in a.block_table.hot_block_ids] == [2, 2, 1]


def test_the_last_prompt_token_is_recomputed_even_when_every_block_is_cached() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("a", 8))
    _run(scheduler)
    scheduler.add(_seq("b", 8))
    batch = _run(scheduler)
    assert _chunks(batch) == [("b", 4)]  # one block reused; the block holding the last token recomputed


def test_tenants_with_different_salts_never_share_blocks() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("a", 10, salt="tenant-a"))
    _run(scheduler)
    scheduler.add(_seq("b", 10, salt="tenant-b"))
    batch = _run(scheduler)
    assert _chunks(batch) == [("b", 10)] and scheduler.num_prompt_tokens_cached == 0
    a, b = scheduler.running
    assert not set(a.block_table.hot_block_ids) & set(b.block_table.hot_block_ids)


def test_release_and_cancel_free_every_block() -> None:
    scheduler = _scheduler()
    pool = scheduler.kv_cache.hot.pool
    seqs = [_seq(name, 9, first=10 * i) for i, name in enumerate("abc")]
    for seq in seqs:
        scheduler.add(seq)
    _run(scheduler)
    assert pool.num_used_blocks() == 9
    seqs[0].finish(FinishReason.STOP)
    scheduler.release(seqs[0])
    assert pool.num_used_blocks() == 6
    assert scheduler.remove(RequestId("c"), FinishReason.CANCELLED) is seqs[2]
    assert pool.num_used_blocks() == 3 and [s.request_id for s in scheduler.running] == ["b"]
    assert scheduler.remove(RequestId("c"), FinishReason.CANCELLED) is None


def test_out_of_blocks_preempts_the_latest_sequence_by_recompute() -> None:
    scheduler = _scheduler(num_blocks=1 + 4, max_batch_size=2)  # 4 usable blocks of 4 tokens
    scheduler.add(_seq("a", 7, first=1))
    scheduler.add(_seq("b", 7, first=20))
    _run(scheduler)  # 2 + 2 blocks for 7 prompt tokens each
    assert len(_run(scheduler).rows) == 2  # position 7 still fits the second block
    decode = _run(scheduler)  # position 8 needs a third block each: only one can have it
    assert _names(decode) == ["a"]
    b = scheduler.waiting["standard"][0]
    assert b.request_id == "b" and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and b.num_preemptions == 1


def _classes(reserved_slots: int = 1) -> IntentClasses:
    return IntentClasses(
        {
            "standard": IntentClass("standard", priority=0, queue_timeout_s=30.0),
            "medical": IntentClass(
                "medical", priority=10, queue_timeout_s=2.0, reserved_slots=reserved_slots
            ),
        }
    )


def test_a_flood_of_low_priority_requests_leaves_the_reserved_slot_free() -> None:
    clock = FakeClock()
    scheduler = _scheduler(max_batch_size=4, classes=_classes(), clock=clock)
    for i in range(50):
        scheduler.add(_seq(f"low{i}", 5, first=i))
    for _ in range(5):
        _run(scheduler)
    assert len(scheduler.running) == 3  # the fourth slot is held for `medical`
    clock.now = 1.0
    scheduler.add(_seq("urgent", 5, intent_class="medical", first=99))
    batch = _run(scheduler)
    assert _chunks(batch) == [("urgent", 5)]  # started at once, within its 2 s timeout
    assert not scheduler.expire()


def test_every_class_of_a_table_that_fits_starts_on_an_idle_engine() -> None:
    """What `check_fits` accepts, the scheduler can serve: for every batch size up to 6 and every
    reservation table that fits it, a request of each class, alone in the queue, starts at once."""
    for max_batch_size in range(1, 7):
        for reserved in itertools.product(range(max_batch_size + 1), repeat=3):
            classes = IntentClasses(
                {
                    name: IntentClass(name, priority=10 * i, reserved_slots=slots)
                    for i, (name, slots) in enumerate(
                        zip(("standard", "interactive", "critical"), reserved, strict=True)
                    )
                }
            )
            try:
                classes.check_fits(max_batch_size)
            except ValueError:
                continue
            for name in classes.by_name:
                scheduler = _scheduler(max_batch_size=max_batch_size, classes=classes)
                scheduler.add(_seq("alone", 3, intent_class=name))
                assert scheduler.schedule() is not None, (max_batch_size, reserved, name)


def test_high_priority_starts_first_when_both_wait() -> None:
    scheduler = _scheduler(max_batch_size=1, classes=_classes(reserved_slots=0))
    scheduler.add(_seq("low", 5))
    scheduler.add(_seq("urgent", 5, intent_class="medical"))
    assert _names(_run(scheduler)) == ["urgent"]


def test_waiting_past_the_class_timeout_expires_the_request() -> None:
    clock = FakeClock()
    scheduler = _scheduler(max_batch_size=1, classes=_classes(reserved_slots=0), clock=clock)
    scheduler.add(_seq("urgent", 5, intent_class="medical"))
    _run(scheduler)
    scheduler.add(_seq("waiting", 5, intent_class="medical"))
    clock.now = 1.5
    assert scheduler.expire() == []
    clock.now = 2.5
    (expired,) = scheduler.expire()
    assert expired.seq.request_id == "waiting" and expired.timeout_s == 2.0 and expired.waited_s == 2.5
    assert scheduler.num_waiting == 0


def test_batch_share_caps_a_class() -> None:
    classes = IntentClasses({"standard": IntentClass("standard", max_batch_share=0.5)})
    scheduler = _scheduler(max_batch_size=4, classes=classes)
    for i in range(4):
        scheduler.add(_seq(f"r{i}", 3, first=i))
    assert len(_run(scheduler).rows) == 2


def test_a_prompt_whose_next_chunk_finds_no_blocks_goes_on_a_token_a_step() -> None:
    """With mixed steps as prompts first: a prompt under way whose chunk finds no room (nothing lower
    to preempt) computes a token of it a step while blocks allow, instead of no row at all."""
    # 5 usable blocks of 4 tokens. `high` (interactive) holds two, `low` (batch) two after its first
    # chunk; its next 8 tokens need two more blocks, one is free, and it cannot preempt `high`
    scheduler = _scheduler(num_blocks=1 + 5, max_batch_size=2, max_prefill_tokens=8)
    scheduler.add(_seq("high", 4, intent_class="interactive", first=1))
    scheduler.add(_seq("low", 16, intent_class="batch", first=50))
    assert _rows(_run(scheduler)) == [("high", 4)]
    assert _rows(_run(scheduler)) == [("high", 1), ("low", 8)]
    for _ in range(2):  # in the pool's last block
        assert _rows(_run(scheduler)) == [("high", 1), ("low", 1)]
    low = next(s for s in scheduler.running if s.request_id == "low")
    assert low.num_computed_tokens == 10 and low.status is SequenceStatus.RUNNING
