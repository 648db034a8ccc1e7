"""Preemption across classes: out of blocks, the scheduler takes the lowest eligible class first, then
the next lowest, never the highest while a lower one runs, and a new request never preempts its own
class."""

from __future__ import annotations

from services.engine.scheduling.sequence import SequenceStatus
from tests.engine.scheduling.test_scheduler import _names, _run, _scheduler, _seq


def test_running_out_of_blocks_preempts_the_lowest_class_first_then_the_next() -> None:
    # 6 usable blocks of 4 tokens; each 7-token prompt takes 2, so three prompts fill the pool. Prompts
    # first (no mixed steps): the three then decode in lockstep, one block boundary for all.
    scheduler = _scheduler(num_blocks=1 + 6, max_batch_size=4, mixed_steps=False)
    low = _seq("low", 7, "batch", first=1)
    mid = _seq("mid", 7, "standard", first=20)
    high = _seq("high", 7, "interactive", first=40)
    scheduler.add(low)
    assert _names(_run(scheduler)) == ["low"]
    # The batch sequence starts first, so "the latest-started sequence" alone would name another victim.
    scheduler.add(mid)
    scheduler.add(high)
    assert sorted(_names(_run(scheduler))) == ["high", "mid"]  # prefill: all 6 blocks in use
    assert len(_run(scheduler).rows) == 3  # position 7 still fits each second block

    third_blocks = _run(scheduler)  # position 8 needs a third block each; one sequence must yield
    assert (low.status, low.num_preemptions) == (SequenceStatus.WAITING, 1), "batch is the lowest class"
    assert (mid.num_preemptions, high.num_preemptions) == (0, 0)
    assert sorted(_names(third_blocks)) == ["high", "mid"]

    while mid.num_preemptions == 0 and high.num_preemptions == 0:  # until the pool runs out again
        _run(scheduler)
    assert (mid.num_preemptions, high.num_preemptions) == (1, 0), "standard yields before interactive"
    assert high.status is SequenceStatus.RUNNING


def test_a_new_request_waits_rather_than_preempt_its_own_class() -> None:
    scheduler = _scheduler(num_blocks=1 + 4, max_batch_size=2)  # 4 usable blocks of 4 tokens
    running = _seq("running", 14, "standard", first=1)  # 4 blocks: the pool is full
    scheduler.add(running)
    _run(scheduler)
    arriving = _seq("arriving", 7, "standard", first=40)
    scheduler.add(arriving)
    assert _names(_run(scheduler)) == ["running"]  # position 14 still fits its fourth block
    assert running.num_preemptions == 0 and arriving.status is SequenceStatus.WAITING
