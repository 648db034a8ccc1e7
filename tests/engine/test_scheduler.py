"""Scheduler: prefill first within the token budget, dense slots after releases and cancels."""

from __future__ import annotations

import torch

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_cache import ContiguousKVCache
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, StepKind
from services.engine.sequence import FinishReason, RequestId, Sequence
from tests.engine.test_kv_cache import ONE_HEAD


def _seq(name: str, num_tokens: int) -> Sequence:
    detokenizer = IncrementalDetokenizer(lambda ids: "", [1])
    return Sequence(RequestId(name), [1] * num_tokens, SamplingParams(), lambda e: None, detokenizer, None)


def _scheduler(slots: int = 3, max_prefill_tokens: int = 100) -> Scheduler:
    cache = ContiguousKVCache(ONE_HEAD, slots, 64, torch.device("cpu"), torch.float32)
    return Scheduler(cache, max_prefill_tokens)


def test_prefill_comes_first_and_respects_the_padded_token_budget() -> None:
    scheduler = _scheduler(max_prefill_tokens=30)
    for name, length in (("a", 10), ("b", 12), ("c", 40)):
        scheduler.add(_seq(name, length))
    first = scheduler.schedule()
    assert first is not None and first.kind is StepKind.PREFILL
    assert [s.request_id for s in first.seqs] == ["a", "b"]  # 2 x 12 padded tokens fit, 3 x 40 do not
    second = scheduler.schedule()
    assert second is not None and [s.request_id for s in second.seqs] == ["c"]  # alone, over budget
    third = scheduler.schedule()
    assert third is not None and third.kind is StepKind.DECODE and len(third.seqs) == 3


def test_slots_stay_dense_after_release_and_cancel() -> None:
    scheduler = _scheduler()
    seqs = [_seq(name, 4) for name in "abc"]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    seqs[0].finish(FinishReason.STOP)
    scheduler.release(seqs[0])
    assert [(s.request_id, s.slot) for s in scheduler.running] == [("c", 0), ("b", 1)]
    assert scheduler.remove(RequestId("c"), FinishReason.CANCELLED) is seqs[2]
    assert [(s.request_id, s.slot) for s in scheduler.running] == [("b", 0)]
    assert scheduler.remove(RequestId("c"), FinishReason.CANCELLED) is None


def test_waiting_requests_wait_for_a_free_slot() -> None:
    scheduler = _scheduler(slots=1)
    scheduler.add(_seq("a", 3))
    scheduler.add(_seq("b", 3))
    batch = scheduler.schedule()
    assert batch is not None and [s.request_id for s in batch.seqs] == ["a"]
    decode = scheduler.schedule()
    assert decode is not None and decode.kind is StepKind.DECODE
    assert scheduler.remove(RequestId("b"), FinishReason.CANCELLED) is not None  # cancel while waiting
    assert not scheduler.waiting
