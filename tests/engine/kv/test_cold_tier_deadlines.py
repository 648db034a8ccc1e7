"""A slow kvstore costs a request its prefix load, never the request: the load gives up within what
the request can afford, and it holds up no other request's loads.

The store here answers Lookup at once and stalls GetBlocks (tests/engine/kv/slow_store.py: a real
gRPC server that fakes only the store's timing). Synchronisation is by the cold tier's own
outcomes and barrier (`wait_for_outcome`, `flush`), never sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.kv_codec.codec import CodecSettings, encode_block, read_layout
from services.common.kvstore_api import BlockHash, Codec
from services.engine.config import EngineConfig
from services.engine.kv.cold_moves import ColdSummaries
from services.engine.kv.cold_tier import ColdTier, ColdTierConfig, Degradation, Job, Operation, Outcome
from services.engine.kv.prefix_fetch import PrefixLayout
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.cold_planner import ColdPlanner
from services.engine.scheduling.intent_class import DEFAULT_CLASS, IntentClass, IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import RequestId, Sequence
from services.engine.text.detokenizer import IncrementalDetokenizer
from tests.engine.kv.slow_store import SlowStore
from tests.engine.kv.test_cold_tier import BLOCK_SIZE, degradations, degraded_events, long_prompt, run
from tests.engine.paged_helpers import ONE_HEAD, make_cache

# Longer than the class's queue timeout below: a request held for all of it fails in the queue.
TRANSFER_DEADLINE_MS = 20_000
QUEUE_TIMEOUT_S = 4.0
LAYOUT = PrefixLayout((2, 2, BLOCK_SIZE, 1, 8))  # a prefix block: [L, 2, BS, KVH, D]
STALLED = tuple(BlockHash(f"{i:02x}" * 32) for i in range(4))  # prompt blocks whose GetBlocks stalls
WINDOW = BlockHash("ee" * 32)  # a demoted block the store serves at once


@pytest.fixture
def store() -> Iterator[SlowStore]:
    """A store that stalls GetBlocks for STALLED and serves WINDOW at once."""
    slow = SlowStore()
    slow.stalled_hashes.update(STALLED)
    keys = torch.randn(2, 32, 1, 8, generator=torch.Generator().manual_seed(0))  # [L, T, KVH, D]
    payload = encode_block(keys, -keys, torch.ones(32), CodecSettings())
    slow.blocks[WINDOW] = (Codec.INT2_SPARSE, tuple(read_layout(payload).dense_shape), payload)
    yield slow.serve()
    slow.stop()


class Sink:
    """Where a prefix load's blocks would go (nothing arrives from a stalled store)."""

    def write(self, first: int, kv: torch.Tensor) -> None:
        raise AssertionError("a stalled store wrote a block")

    def finish(self) -> None:
        pass

    def wait_for(self, fence: object) -> None:
        pass


def prefix_load(owner: str, **deadline: float) -> Job:
    return Job(Operation.LOAD_PREFIX, owner, "", (), STALLED, layout=LAYOUT, sink=Sink(), **deadline)


def next_outcomes(tier: ColdTier, timeout_s: float = 30.0) -> list[Outcome]:
    """What the tier reports next; empty when nothing came within `timeout_s` (the test fails)."""
    tier.wait_for_outcome(timeout_s)
    return tier.take_outcomes()


def load_engine(model: Path, cold: ColdTierConfig) -> LLMEngine:
    """stories260K, its default class with a short queue timeout."""
    classes = IntentClasses({DEFAULT_CLASS: IntentClass(DEFAULT_CLASS, queue_timeout_s=QUEUE_TIMEOUT_S)})
    return LLMEngine.load(
        model, device="cpu", dtype="bfloat16", max_batch_size=2, max_seq_len=512, progress=False,
        kv=KVCacheSpec(block_size=BLOCK_SIZE, tiers=TierConfig()), classes=classes, cold=cold,
    )  # fmt: skip


def test_a_request_computes_its_prompt_when_the_store_streams_its_prefix_too_slowly(
    stories_hf_dir: Path, store: SlowStore
) -> None:
    """Lookup says the whole prefix is stored, GetBlocks never comes: the request stops waiting
    within its class's queue timeout, computes its prompt, and completes as with no store at all."""
    store.stall_every_get = True
    cold = ColdTierConfig(target=store.target, transfer_deadline_ms=TRANSFER_DEADLINE_MS, retry_after_s=600)
    engine = load_engine(stories_hf_dir, cold)
    plain = load_engine(stories_hf_dir, ColdTierConfig())
    prompt = long_prompt(engine)
    before = degradations("load_prefix", "deadline")

    collector = run(engine, prompt)

    result = collector.result()
    assert result.error is None, result.error
    assert result.token_ids == run(plain, prompt).result().token_ids
    assert store.num_stalled_calls == 1  # the store did stall the prefix's GetBlocks
    assert engine.stats().num_prefill_tokens_computed == len(prompt)
    assert degradations("load_prefix", "deadline") == before + 1
    (event,) = degraded_events(collector)
    assert event["thermocline.kv.reason"] == "deadline" and event["thermocline.kv.fallback"] == "hot+warm"
    engine.stop()
    plain.stop()


def test_a_window_load_does_not_wait_behind_a_stalled_prefix_load(store: SlowStore) -> None:
    """A decoding request's window comes while another request's prefix transfer is stalled."""
    tier = ColdTier(ColdTierConfig(target=store.target, transfer_deadline_ms=120_000), "m", page_tokens=16)
    tier.submit(prefix_load("new request"))
    tier.submit(Job(Operation.LOAD_WINDOW, "decoding request", "", (), (WINDOW,)))

    (window,) = next_outcomes(tier)
    assert window.owner == "decoding request" and window.degraded is None
    assert [b.block_hash for b in window.loaded] == [WINDOW]
    store.release()
    tier.flush()
    (prefix,) = tier.take_outcomes()
    assert prefix.owner == "new request"
    tier.close()


def test_a_prefix_load_gives_up_at_its_deadline_even_behind_another_load(store: SlowStore) -> None:
    """The second load waits behind a stalled one on the prefix loader, yet its request hears at its
    deadline that it is on its own; the load's own outcome (its blocks' release) comes later."""
    tier = ColdTier(ColdTierConfig(target=store.target, transfer_deadline_ms=120_000), "m", page_tokens=16)
    tier.submit(prefix_load("patient"))
    began = time.monotonic()
    tier.submit(prefix_load("hurried", deadline_s=began + 0.5))

    (gave_up,) = next_outcomes(tier)
    assert time.monotonic() - began >= 0.5
    assert gave_up.owner == "hurried" and gave_up.gave_up
    assert gave_up.degraded is Degradation.DEADLINE and gave_up.prefix_blocks == 0
    store.release()
    tier.flush()
    outcomes = {o.owner: o for o in tier.take_outcomes()}
    assert set(outcomes) == {"patient", "hurried"}
    assert not outcomes["hurried"].gave_up and outcomes["hurried"].degraded is Degradation.DEADLINE
    assert not outcomes["patient"].gave_up
    tier.close()


def test_a_prefix_load_done_in_time_reports_no_give_up(store: SlowStore) -> None:
    store.release()  # the store answers at once (all misses)
    tier = ColdTier(ColdTierConfig(target=store.target, transfer_deadline_ms=120_000), "m", page_tokens=16)
    tier.submit(prefix_load("on time", deadline_s=time.monotonic() + 60))
    tier.flush()
    (outcome,) = tier.take_outcomes()  # Lookup said stored, GetBlocks missed: corrupt, not late
    assert not outcome.gave_up and outcome.degraded is Degradation.CORRUPT
    assert tier._give_ups.num_pending == 0  # its give-up was cancelled: it never comes
    tier.close()


def test_a_prefix_load_may_take_half_its_class_queue_timeout_at_most() -> None:
    cache = make_cache(ONE_HEAD, block_size=BLOCK_SIZE)
    config = ColdTierConfig(target="127.0.0.1:9", prefix_load_deadline_ms=20_000)
    tier = ColdTier(config, "m", page_tokens=BLOCK_SIZE)  # never called
    planner = ColdPlanner(
        tier, cache, ColdSummaries(0, 1, 2, torch.device("cpu")), classes=IntentClasses.builtin()
    )
    budgets = {}
    for intent_class in ("critical", "interactive", DEFAULT_CLASS):
        seq = Sequence(
            RequestId(intent_class), [1, 2], SamplingParams(), lambda e: None, detokenizer(), None,
            intent_class=intent_class,
        )  # fmt: skip
        budgets[intent_class] = planner.prefix_load_budget_s(seq)
    assert budgets == {"critical": 5.0, "interactive": 15.0, DEFAULT_CLASS: 20.0}  # queue 10, 30, 60 s
    tier.close()


def test_the_prefix_load_deadline_is_a_setting() -> None:
    assert EngineConfig.from_env({}).cold.prefix_load_deadline_ms == 5_000
    environ = {"THERMOCLINE_ENGINE_KVSTORE_PREFIX_LOAD_DEADLINE_MS": "750"}
    assert EngineConfig.from_env(environ).cold.prefix_load_deadline_ms == 750


def detokenizer() -> IncrementalDetokenizer:
    return IncrementalDetokenizer(lambda ids: "", [1])
