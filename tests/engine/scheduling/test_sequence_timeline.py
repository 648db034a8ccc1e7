"""The scheduler stamps each Sequence's timeline: queue waits, prefill chunks, preemption events."""

from __future__ import annotations

import itertools

from services.engine.scheduling.sequence import FinishReason
from tests.engine.scheduling.test_scheduler import _run, _scheduler, _seq


def test_preemption_is_an_event_and_opens_a_second_queue_wait() -> None:
    scheduler = _scheduler(num_blocks=1 + 4, max_batch_size=2)  # 4 usable blocks of 4 tokens
    a, b = _seq("a", 7, first=1), _seq("b", 7, first=20)
    scheduler.add(a)
    scheduler.add(b)
    _run(scheduler)
    _run(scheduler)
    _run(scheduler)  # position 8 needs a third block each: b is preempted
    assert [e.name for e in b.timeline.events] == ["thermocline.preemption"]
    assert b.timeline.events[0].attributes["thermocline.preemption.count"] == 1
    assert len(b.timeline.queue_waits) == 1  # the first wait closed; the second is open
    a.finish(FinishReason.STOP)
    scheduler.release(a)
    _run(scheduler)  # b is re-admitted and recomputes its tokens
    assert len(b.timeline.queue_waits) == 2
    # the first prefill, then the recompute of its prompt and the 2 tokens it had sampled
    assert [c.num_tokens for c in b.timeline.prefill_chunks] == [7, 9]
    assert b.timeline.queue_waits[1].start_ns >= b.timeline.events[0].time_ns


def test_chunked_prefill_records_each_chunk_and_the_first_token() -> None:
    scheduler = _scheduler(max_prefill_tokens=4)
    seq = _seq("long", 10)
    scheduler.add(seq)
    for _ in range(3):
        _run(scheduler)
    chunks = seq.timeline.prefill_chunks
    assert [c.num_tokens for c in chunks] == [4, 4, 2]
    assert all(x.end_ns <= y.start_ns for x, y in itertools.pairwise(chunks))
    assert seq.timeline.queue_waits[0].end_ns <= chunks[0].start_ns
