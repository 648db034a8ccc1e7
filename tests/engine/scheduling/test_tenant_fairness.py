"""Fairness between tenants inside one intent class: a free slot goes to the waiting request whose
tenant (its `cache_salt`) runs the fewest of the class, not to the head of one tenant's backlog."""

from __future__ import annotations

from services.engine.scheduling.scheduler import Scheduler
from services.engine.scheduling.sequence import FinishReason, SequenceStatus
from tests.engine.scheduling.test_scheduler import _chunks, _run, _scheduler, _seq


def _running(scheduler: Scheduler) -> list[str]:
    return [s.request_id for s in scheduler.running]


def test_another_tenants_request_takes_the_next_free_slot_ahead_of_a_backlog() -> None:
    scheduler = _scheduler(max_batch_size=3)
    for i in range(10):
        scheduler.add(_seq(f"a{i}", 3, salt="tenant-a", first=10 * i))
    _run(scheduler)
    assert _running(scheduler) == ["a0", "a1", "a2"]
    scheduler.add(_seq("b0", 3, salt="tenant-b", first=500))  # behind 7 of a's requests
    _run(scheduler)  # every slot still taken: b0 waits
    assert scheduler.waiting["standard"][-1].request_id == "b0"
    finished = scheduler.running[0]
    finished.finish(FinishReason.STOP)
    scheduler.release(finished)
    assert _chunks(_run(scheduler)) == [("b0", 3)]
    assert [s.request_id for s in scheduler.waiting["standard"]] == [f"a{i}" for i in range(3, 10)]


def test_tenants_take_turns_and_ties_go_by_arrival() -> None:
    scheduler = _scheduler(max_batch_size=5)
    for i in range(4):
        scheduler.add(_seq(f"a{i}", 3, salt="tenant-a", first=10 * i))
    for i in range(2):
        scheduler.add(_seq(f"b{i}", 3, salt="tenant-b", first=100 + 10 * i))
    scheduler.add(_seq("c0", 3, salt="tenant-c", first=200))
    # a0 (a: 0 running, first to arrive), b0 (b: 0), c0 (c: 0), then a and b run one each: a1, b1
    assert [name for name, _ in _chunks(_run(scheduler))] == ["a0", "b0", "c0", "a1", "b1"]


def test_a_preempted_request_keeps_its_place_at_the_head() -> None:
    """It has streamed tokens already: it resumes before any new request, whatever its tenant runs."""
    scheduler = _scheduler(max_batch_size=2)
    scheduler.add(_seq("a0", 3, salt="tenant-a", first=1))
    scheduler.add(_seq("a1", 3, salt="tenant-a", first=20))
    _run(scheduler)
    a1 = scheduler.running[1]
    scheduler.preempt(a1)  # what running out of hot blocks does
    scheduler.add(_seq("b0", 3, salt="tenant-b", first=40))
    # a runs a0 and b runs none, yet a1 comes first (recomputing its prompt and its one token)
    assert _chunks(_run(scheduler)) == [("a1", 4)]
    assert a1.status is SequenceStatus.RUNNING
    assert [s.request_id for s in scheduler.waiting["standard"]] == ["b0"]
