"""The engine's cold tier against a real kvstore process over a real redis-server and real files.

Prefix reuse: a second engine (a fresh replica) loads a long shared prompt prefix that the first
one computed and stored, instead of computing it. Fallback: a kvstore killed mid-request, frozen
(deadline) or serving a corrupt block costs the request nothing but the cold tier; the request
completes on hot + warm, and the degradation is a metric and an event on the request's trace.
Synchronisation is by the cold tier's own barrier (`ColdTier.flush`) and health checks, never sleeps.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from services.common.kvstore_api import BlockHash, BlockSource, KVStoreClient, MissReason, Namespace
from services.engine.errors import UnknownRetrievalMode
from services.engine.kv.block_pool import BlockHash as BlockHashBytes
from services.engine.kv.block_pool import hash_prefix_blocks
from services.engine.kv.block_table import ColdBlock
from services.engine.kv.cold_moves import ColdSummaries
from services.engine.kv.cold_tier import DEFAULT_TENANT, ColdTier, ColdTierConfig
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.cold_planner import ColdPlanner
from services.engine.scheduling.intent_class import DEFAULT_CLASS, IntentClass, IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import RequestId, Sequence
from services.engine.serving.generation_result import GenerationResult, ResultCollector
from services.engine.text.detokenizer import IncrementalDetokenizer
from tests.conftest import holding_service_token
from tests.engine.fake_clock import FakeClock
from tests.engine.paged_helpers import ONE_HEAD, make_cache
from tests.kvstore.conftest import KVStoreProcess, RedisServer

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
    "her friends. One day, she saw a big red ball under a tree. She ran to the ball and picked it up. "
    "Her mom smiled and said they could take it home. Lily was very happy and hugged her mom. "
)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
BLOCK_SIZE = 16
# A healthy store on a loaded 2-core CI box can take seconds; only the frozen-store test is about time.
HEALTHY = {"deadline_ms": 60_000, "transfer_deadline_ms": 120_000, "prefix_load_deadline_ms": 120_000}
# A hot window and a warm tier of two groups each: a story's prompt sends most of its groups cold.
WINDOW_TIERS = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=32, group_size=16)


@pytest.fixture
def kvstore(tmp_path: Path) -> Iterator[KVStoreProcess]:
    """A kvstore of its own over a redis-server of its own (tests break both)."""
    redis = RedisServer(tmp_path).start()
    process = KVStoreProcess(tmp_path / "kvstore", redis.url).start()
    with holding_service_token(process.service_token.path):  # the engine here calls as the engine
        yield process
    if process.process is not None and process.process.poll() is None:
        process.process.send_signal(signal.SIGCONT)  # a test may leave it frozen
    process.stop()
    redis.stop()


def load_engine(model: Path, cold: ColdTierConfig, tiers: TierConfig | None = None) -> LLMEngine:
    """stories260K in BF16 (the dtype prompt blocks are stored in, so a loaded prefix is exact)."""
    return LLMEngine.load(
        model, device="cpu", dtype="bfloat16", max_batch_size=2, max_seq_len=512, progress=False,
        kv=KVCacheSpec(block_size=BLOCK_SIZE, tiers=tiers or TierConfig()), cold=cold,
    )  # fmt: skip


def long_prompt(engine: LLMEngine) -> list[int]:
    """About 300 tokens of story: 18 full blocks of shared prefix."""
    return engine.tokenizer.encode(STORY * 5)[:300]


def run(
    engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY, **submit: str
) -> ResultCollector:
    """Submit and step the engine by hand until the request ends."""
    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector, **submit)
    while not collector.done.is_set():
        engine.step()
    return collector


def store_prefix(engine: LLMEngine, prompt: list[int]) -> GenerationResult:
    """The first replica computes the prompt; its prompt blocks are durable in the store on return."""
    result = run(engine, prompt).result()
    assert engine.cold is not None
    engine.cold.tier.flush()
    engine.step()  # takes the store's acknowledgements
    return result


def prompt_block_hashes(engine: LLMEngine, prompt: list[int]) -> list[BlockHashBytes]:
    """The prompt's chained block hashes, as the engine names them (no cache salt)."""
    return hash_prefix_blocks(prompt, BLOCK_SIZE, engine.model_id, "")


def step_until_a_window_loads(engine: LLMEngine, collector: ResultCollector) -> None:
    """Step (flushing the kvstore threads) until the auxiliary window has loaded a cold block; the
    request must still be running then."""
    assert engine.cold is not None
    while engine.cold.stats.window_loads == 0:
        assert not collector.done.is_set(), "the request ended before its auxiliary window loaded"
        engine.step()
        engine.cold.tier.flush()


def degradations(operation: str, reason: str) -> float:
    """The degradation counter's value for one label pair."""
    labels = {"operation": operation, "reason": reason}
    return REGISTRY.get_sample_value("thermocline_engine_kv_cold_degradations_total", labels) or 0.0


def degraded_events(collector: ResultCollector) -> list[dict[str, object]]:
    """The attributes of the request's `thermocline.kv.cold_degraded` trace events."""
    event = collector.final_event
    assert event is not None and event.timeline is not None
    return [dict(e.attributes) for e in event.timeline.events if e.name == "thermocline.kv.cold_degraded"]


def test_a_second_replica_loads_a_long_shared_prefix_instead_of_computing_it(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    assert first.stats().num_prefill_tokens_computed == len(prompt)
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE  # the last prompt token is always computed
    assert first.stats().cold.prefix_blocks_stored == num_blocks  # type: ignore[union-attr]

    second = load_engine(stories_hf_dir, cold)
    collector = run(second, prompt)
    stats = second.stats()
    num_loaded = num_blocks * BLOCK_SIZE
    assert stats.cold.prompt_tokens_loaded == num_loaded  # type: ignore[union-attr]
    assert stats.num_prefill_tokens_computed == len(prompt) - num_loaded
    assert collector.result().token_ids == expected.token_ids
    usage = collector.final_event.usage  # type: ignore[union-attr]
    assert usage is not None and usage.cold_prompt_tokens == num_loaded
    assert usage.cached_prompt_tokens == num_loaded
    # the loaded pages hold exactly what the first replica computed (BF16 round trip)
    hashes = second.scheduler.kv_cache.hot.pool._by_hash
    for block_hash in prompt_block_hashes(second, prompt)[:num_blocks]:
        a = first.runner.kv_cache.hot.keys[:, first.scheduler.kv_cache.hot.pool._by_hash[block_hash]]
        b = second.runner.kv_cache.hot.keys[:, hashes[block_hash]]
        assert torch.equal(a, b)
    first.stop()
    second.stop()


def test_hits_one_after_another_reuse_the_kept_host_buffer_and_each_loads_its_own_prefix(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """The host buffer a hit lands in is kept and reused by the next hit (a fetch returns only once
    its blocks are in the cache); an engine that keeps none gives each hit a buffer of its own."""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompts = [long_prompt(first), first.tokenizer.encode(STORY.replace("Lily", "Sam") * 5)[:280]]
    expected = [store_prefix(first, prompt).token_ids for prompt in prompts]
    num_blocks = sum((len(p) - 1) // BLOCK_SIZE for p in prompts)
    for staging_mb in (cold.prefix_staging_mb, 0):
        second = load_engine(stories_hf_dir, dataclasses.replace(cold, prefix_staging_mb=staging_mb))
        assert second.cold is not None
        staging = second.cold.tier._prefixes._staging  # the loader thread's; read between steps only
        if staging_mb:
            assert staging is not None and len(staging) == (512 - 1) // BLOCK_SIZE  # a max_seq_len prompt
        else:
            assert staging is None
        for prompt, tokens in zip(prompts, expected, strict=True):
            assert run(second, prompt).result().token_ids == tokens
        assert second.cold.stats.prompt_tokens_loaded == num_blocks * BLOCK_SIZE
        assert second.scheduler.kv_cache.hot.pool.num_used_blocks() == 0  # every loaded block went back
        second.stop()
    first.stop()


def test_a_prefix_load_keeps_its_blocks_until_the_loader_is_done_even_when_cancelled(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """The loader thread writes the hot blocks allocated for a load: a request cancelled while its
    load is in flight must not give them back (another request could be handed them under the
    loader's writes) until the load's outcome comes."""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompt = long_prompt(first)
    store_prefix(first, prompt)
    second = load_engine(stories_hf_dir, cold)
    assert second.cold is not None and kvstore.process is not None
    pool = second.scheduler.kv_cache.hot.pool

    def loaders_blocks() -> int:
        """Blocks allocated but in no running request's table."""
        return pool.num_used_blocks() - sum(
            len(s.block_table.hot_block_ids) for s in second.scheduler.running
        )

    busy = ResultCollector([1, 2, 3])  # work to step, so that no step waits for the frozen load
    busy_handle = second.submit(
        [1, 2, 3], SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True), busy
    )
    second.step()
    kvstore.process.send_signal(signal.SIGSTOP)  # the load waits on the store, its blocks allocated
    collector = ResultCollector(prompt)
    handle = second.submit(prompt, GREEDY, collector)
    second.step()
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert second.cold.num_held == 1 and loaders_blocks() == num_blocks
    second.cancel(handle)
    second.step()
    assert collector.done.is_set() and second.cold.num_held == 0
    assert loaders_blocks() == num_blocks  # still the loader's
    kvstore.process.send_signal(signal.SIGCONT)
    second.cold.tier.flush()
    second.step()  # takes the load's outcome
    assert loaders_blocks() == 0 and second.cold.num_load_blocks == 0
    second.cancel(busy_handle)
    while not busy.done.is_set():
        second.step()
    assert pool.num_used_blocks() == 0
    first.stop()
    second.stop()


def test_a_prefix_load_starts_only_after_the_tier_moves_decided_before_it(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """Its blocks were free when allocated, but a store or warm copy decided before may still read
    them at the next launch: the load is held until the runner has carried the moves out (in the
    next step, or at once when no step comes), and only then reaches the loader thread."""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    second = load_engine(stories_hf_dir, cold)
    assert second.cold is not None
    tier = second.cold.tier
    collector = ResultCollector(prompt)
    second.submit(prompt, GREEDY, collector)
    second._drain_inbox()  # the request arrives: its load is decided, its blocks allocated
    assert second.cold.num_held == 1 and tier.has_fenced
    # the step thread sleeps only when there is no work: a held load is work (a step with nothing
    # to run carries the moves out); else a load decided while no next step came would never start
    assert second._has_work()
    tier.flush()
    assert not tier.has_outcomes  # never reached the loader
    second.runner.carry_out_moves()  # what an idle engine does (a step does it in its launch)
    assert not tier.has_fenced
    tier.flush()
    assert tier.has_outcomes
    while not collector.done.is_set():
        second.step()
    assert collector.result().token_ids == expected.token_ids
    assert second.cold.stats.prompt_tokens_loaded == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    first.stop()
    second.stop()


def test_prefix_loads_hold_at_most_half_the_hot_pool_and_the_rest_is_computed(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """Blocks held by loads belong to no running request, so preemption cannot take them back: two
    18-block loads at once would hold 36 of the 64-block pool, so the second prompt is computed.
    (One load always goes through, whatever its size: the expiry test's 18 blocks of a 32-block pool.)"""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompts = [long_prompt(first), first.tokenizer.encode(STORY.replace("Lily", "Sam") * 5)[:300]]
    expected = [store_prefix(first, prompt).token_ids for prompt in prompts]
    second = load_engine(stories_hf_dir, cold)
    assert second.cold is not None
    pool = second.scheduler.kv_cache.hot.pool
    assert pool.num_blocks == 64 and all((len(p) - 1) // BLOCK_SIZE == 18 for p in prompts)
    collectors = [ResultCollector(prompt) for prompt in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        second.submit(prompt, GREEDY, collector)
    second._drain_inbox()  # both arrive in one step
    assert second.cold.num_held == 1 and second.cold.num_load_blocks == 18
    while not all(c.done.is_set() for c in collectors):
        second.step()
    assert [c.result().token_ids for c in collectors] == expected
    assert second.cold.stats.prompt_tokens_loaded == 18 * BLOCK_SIZE  # one loaded, one computed
    assert second.cold.num_load_blocks == 0 and pool.num_used_blocks() == 0
    first.stop()
    second.stop()


def test_a_prefix_stored_by_a_tiered_engine_reloads_as_it_was_computed(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """A one-chunk prompt demotes most of its blocks in the step that fills them: each is stored from
    its own page (read before demotion maps it to the scratch block), so a reuse equals a recompute."""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold, WINDOW_TIERS)
    prompt = long_prompt(first)
    store_prefix(first, prompt)
    plain = load_engine(stories_hf_dir, ColdTierConfig())  # no cold tier, no tiers: computed in full
    expected = run(plain, prompt).result()
    second = load_engine(stories_hf_dir, cold)
    collector = run(second, prompt)
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert second.stats().cold.prompt_tokens_loaded == num_blocks * BLOCK_SIZE  # type: ignore[union-attr]
    assert collector.result().token_ids == expected.token_ids
    for engine in (first, plain, second):
        engine.stop()


def test_a_corrupt_block_ends_the_loaded_prefix_there_and_the_rest_is_computed(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    bad = BlockHash(prompt_block_hashes(first, prompt)[5].hex())
    with KVStoreClient(kvstore.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        payload = client.get([bad])[bad].payload  # type: ignore[union-attr]
    segment = next(p for p in (kvstore.data_dir / "segments").glob("*.seg") if payload in p.read_bytes())
    data = bytearray(segment.read_bytes())
    data[data.index(payload) + 7] ^= 0x01
    segment.write_bytes(bytes(data))
    before = degradations("load_prefix", "corrupt")

    second = load_engine(stories_hf_dir, cold)
    collector = run(second, prompt)
    assert collector.result().token_ids == expected.token_ids
    assert second.stats().cold.prompt_tokens_loaded == 5 * BLOCK_SIZE  # type: ignore[union-attr]
    assert second.stats().num_prefill_tokens_computed == len(prompt) - 5 * BLOCK_SIZE
    assert degradations("load_prefix", "corrupt") == before + 1
    assert [e["thermocline.kv.reason"] for e in degraded_events(collector)] == ["corrupt"]
    second.cold.tier.flush()  # type: ignore[union-attr]
    with KVStoreClient(kvstore.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        healed = client.get([bad])[bad]  # the store dropped the corrupt record; the recompute put it back
    assert not isinstance(healed, MissReason) and healed.payload == payload
    first.stop()
    second.stop()


def test_a_frozen_kvstore_costs_a_deadline_and_the_prompt_is_computed(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    first = load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, **HEALTHY))
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    assert kvstore.process is not None
    kvstore.process.send_signal(signal.SIGSTOP)  # alive, holding its port, answering nothing
    before = degradations("load_prefix", "deadline")

    second = load_engine(
        stories_hf_dir, ColdTierConfig(target=kvstore.target, deadline_ms=300, retry_after_s=600)
    )
    collector = run(second, prompt)
    assert collector.result().token_ids == expected.token_ids
    assert second.stats().num_prefill_tokens_computed == len(prompt)
    assert degradations("load_prefix", "deadline") == before + 1
    events = degraded_events(collector)
    assert events[0]["thermocline.kv.reason"] == "deadline"
    assert events[0]["thermocline.kv.fallback"] == "hot+warm"
    assert second.cold is not None and second.cold.tier.is_backing_off  # later requests skip the store
    kvstore.process.send_signal(signal.SIGCONT)
    first.stop()
    second.stop()


def test_the_request_completes_when_the_kvstore_is_killed_mid_request(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """Warm overflow goes cold, the auxiliary window loads it back, then the store dies under it."""
    cold = ColdTierConfig(target=kvstore.target, score_every_steps=4, aux_window_tokens=32, **HEALTHY)
    engine = load_engine(stories_hf_dir, cold, WINDOW_TIERS)
    assert engine.cold is not None
    prompt = engine.tokenizer.encode(STORY)
    params = SamplingParams(max_new_tokens=120, temperature=0.0)
    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector, retrieval_mode="semantic")
    step_until_a_window_loads(engine, collector)  # until a cold block is attended again
    num_before = engine.cold.stats.degradations
    kvstore.kill()
    while not collector.done.is_set():
        engine.step()

    result = collector.result()
    assert result.error is None and len(result.token_ids) == params.max_new_tokens
    assert engine.cold.stats.degradations > num_before
    events = degraded_events(collector)
    assert events and {e["thermocline.kv.reason"] for e in events} == {"unavailable"}
    assert degradations(str(events[0]["thermocline.kv.operation"]), "unavailable") >= 1
    usage = collector.final_event.usage  # type: ignore[union-attr]
    assert usage is not None and usage.cold_tokens > 0  # the window was attended while it lasted
    engine.stop()


def test_a_window_is_scored_as_soon_as_its_request_has_stored_cold_blocks(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """The cadence alone (every 1,000 steps here) would never score a short answer's window."""
    cold = ColdTierConfig(target=kvstore.target, score_every_steps=1000, aux_window_tokens=32, **HEALTHY)
    engine = load_engine(stories_hf_dir, cold, WINDOW_TIERS)
    assert engine.cold is not None
    prompt = engine.tokenizer.encode(STORY)
    collector = ResultCollector(prompt)
    params = SamplingParams(max_new_tokens=60, temperature=0.0)
    engine.submit(prompt, params, collector, retrieval_mode="semantic")
    step_until_a_window_loads(engine, collector)
    while not collector.done.is_set():
        engine.step()
    assert collector.result().error is None
    engine.stop()


def test_a_window_whose_best_block_is_not_stored_yet_is_scored_again_at_the_next_step() -> None:
    """Demotions are acknowledged a step or two after they are queued. A first scoring whose choice
    is only unstored blocks loads nothing; it must not wait `score_every_steps` for another try."""
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=32, group_size=16)
    cache = make_cache(ONE_HEAD, block_size=BLOCK_SIZE, tiers=tiers)
    config = ColdTierConfig(target="127.0.0.1:9", score_every_steps=1000, aux_window_tokens=16)
    tier = ColdTier(config, "m", page_tokens=BLOCK_SIZE)  # never called: nothing stored is chosen
    planner = ColdPlanner(tier, cache, ColdSummaries(0, 1, 2, torch.device("cpu")))
    detokenizer = IncrementalDetokenizer(lambda ids: "", [1])
    seq = Sequence(RequestId("r"), [1, 2], SamplingParams(), lambda e: None, detokenizer, None, tiers)
    seq.uses_aux_window = True
    seq.block_table.cold_blocks = {1: ColdBlock("aa" * 8, 0, is_stored=True), 2: ColdBlock("bb" * 8, 1)}
    assert [row.owner for row in planner.rows_to_score([seq])] == ["r"]
    planner.choose_window(seq, [1])  # the query's best block is the one still on its way
    assert [row.owner for row in planner.rows_to_score([seq])] == ["r"]
    planner.choose_window(seq, [0])
    assert planner.rows_to_score([seq]) == []  # a choice was made: the cadence takes over
    tier.close()


def test_the_blocks_ranked_after_the_window_are_staged_in_the_stores_ram(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """A scoring ranks the window's blocks and as many runner-ups; the runner-ups go to the store in
    one Prefetch, so the scoring that later picks one reads it from RAM."""
    cold = ColdTierConfig(target=kvstore.target, score_every_steps=4, aux_window_tokens=16, **HEALTHY)
    engine = load_engine(stories_hf_dir, cold, WINDOW_TIERS)
    assert engine.cold is not None
    prompt = engine.tokenizer.encode(STORY)
    collector = ResultCollector(prompt)
    engine.submit(
        prompt, SamplingParams(max_new_tokens=60, temperature=0.0), collector, retrieval_mode="semantic"
    )
    while engine.cold.stats.blocks_prefetched == 0:
        assert not collector.done.is_set(), "the request ended before a scoring had a runner-up to stage"
        engine.step()
    engine.cold.tier.flush()  # the Prefetch call has returned: the store has queued the blocks
    (staged,) = engine.cold._prefetched.values()  # the names the engine asked for
    assert len(staged) == engine.cold.stats.blocks_prefetched
    with KVStoreClient(kvstore.target, Namespace(DEFAULT_TENANT, engine.model_id)) as client:
        fetched = client.get(sorted(staged))
    assert {block.source for block in fetched.values()} == {BlockSource.STAGING}  # type: ignore[union-attr]
    while not collector.done.is_set():
        engine.step()
    assert collector.result().error is None
    engine.stop()


def test_a_scoring_stages_each_runner_up_once_and_only_stored_ones() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=32, group_size=16)
    cache = make_cache(ONE_HEAD, block_size=BLOCK_SIZE, tiers=tiers)
    config = ColdTierConfig(target="127.0.0.1:9", score_every_steps=1000, aux_window_tokens=16)
    tier = ColdTier(config, "m", page_tokens=BLOCK_SIZE)  # its calls fail: only what is asked counts
    planner = ColdPlanner(tier, cache, ColdSummaries(0, 1, 2, torch.device("cpu")))
    detokenizer = IncrementalDetokenizer(lambda ids: "", [1])
    seq = Sequence(RequestId("r"), [1, 2], SamplingParams(), lambda e: None, detokenizer, None, tiers)
    seq.uses_aux_window = True
    seq.block_table.cold_blocks = {
        first: ColdBlock(name * 8, slot, is_stored=name != "cc")
        for slot, (first, name) in enumerate([(1, "aa"), (2, "bb"), (3, "cc"), (4, "dd")])
    }
    (row,) = planner.rows_to_score([seq])
    assert row.num_blocks == 2  # the window's one block and one runner-up (-1: as many again)
    planner.choose_window(seq, [0, 1])
    assert planner.stats.blocks_prefetched == 1  # slot 1 ("bb")
    planner.choose_window(seq, [0, 1])
    assert planner.stats.blocks_prefetched == 1  # asked once per request
    planner.choose_window(seq, [3, 2])  # "cc" is not stored yet: nothing to stage
    assert planner.stats.blocks_prefetched == 1
    planner.choose_window(seq, [0, 3])
    assert planner.stats.blocks_prefetched == 2
    tier.close()


def test_a_retrieval_mode_the_engine_does_not_know_is_refused(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    engine = load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, **HEALTHY))
    with pytest.raises(UnknownRetrievalMode, match="semantic"):
        engine.submit([1, 2, 3], GREEDY, ResultCollector([1, 2, 3]), retrieval_mode="psychic")
    engine.stop()


def test_a_running_engine_serves_every_request_while_the_kvstore_is_down_and_after_it_returns(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """The engine's own thread (not stepped by hand): prefix loads that fail wake it, and nothing hangs."""
    engine = load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, retry_after_s=0, **HEALTHY))
    engine.start()

    def serve(tag: str) -> list[GenerationResult]:
        collectors = []
        for n in range(3):
            prompt = engine.tokenizer.encode(f"{tag} {n} {STORY}")
            collectors.append(ResultCollector(prompt))
            engine.submit(prompt, GREEDY, collectors[-1])
        for collector in collectors:
            assert collector.done.wait(120), "a request never finished"
        return [c.result() for c in collectors]

    assert all(r.error is None for r in serve("up"))
    kvstore.kill()
    before = engine.stats().cold.degradations  # type: ignore[union-attr]
    assert all(r.error is None for r in serve("down"))
    assert engine.stats().cold.degradations > before  # type: ignore[union-attr]
    kvstore.start()
    assert all(r.error is None for r in serve("back"))
    engine.stop()


def test_the_cold_blocks_are_scored_at_the_layer_the_config_names(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """`score_layer` picks the layer whose keys the summaries hold (-1: the middle one); a layer past
    the model is refused at load with the setting's name."""
    default = load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, **HEALTHY))
    assert default.runner.cold_summaries is not None
    assert default.runner.cold_summaries.layer == default.config.num_layers // 2
    default.stop()
    first = load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, score_layer=0, **HEALTHY))
    assert first.runner.cold_summaries is not None and first.runner.cold_summaries.layer == 0
    first.stop()
    with pytest.raises(ValueError, match="AUX_SCORE_LAYER"):
        load_engine(stories_hf_dir, ColdTierConfig(target=kvstore.target, score_layer=99, **HEALTHY))
    with pytest.raises(ValueError, match="score_layer"):
        ColdTierConfig(score_layer=-2)


def test_a_request_that_expires_in_the_queue_lets_its_loaded_prefix_go(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """Its prefix came back, but the batch was full and its queue timeout ran out: the hot blocks
    its prefix was loaded into must go back to the pool, not stay with a request that never maps them.
    (The queue's clock is the test's: the load's own deadline, half the queue timeout, is real time.)"""
    cold = ColdTierConfig(target=kvstore.target, **HEALTHY)
    first = load_engine(stories_hf_dir, cold)
    prompt = long_prompt(first)
    store_prefix(first, prompt)
    classes = IntentClasses({DEFAULT_CLASS: IntentClass(DEFAULT_CLASS, queue_timeout_s=120.0)})
    second = LLMEngine.load(
        stories_hf_dir, device="cpu", dtype="bfloat16", max_batch_size=1, max_seq_len=512, progress=False,
        kv=KVCacheSpec(block_size=BLOCK_SIZE), cold=cold, classes=classes,
    )  # fmt: skip
    assert second.cold is not None
    second.scheduler.clock = clock = FakeClock()
    busy = ResultCollector([1, 2, 3])
    handle = second.submit(
        [1, 2, 3], SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True), busy
    )
    second.step()  # the only batch slot is taken
    waiting = ResultCollector(prompt)
    second.submit(prompt, GREEDY, waiting)
    second.step()  # it arrives: its prefix load starts
    second.cold.tier.flush()
    while second.cold.num_held:  # until its prefix is back and it waits in the queue
        second.step()
    assert second.cold.num_load_blocks == (len(prompt) - 1) // BLOCK_SIZE
    clock.now += 121.0
    while not waiting.done.is_set():
        second.step()
    assert waiting.result().error is not None  # expired in the queue
    with KVStoreClient(kvstore.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        served = client.stats()
    assert served.staging_hits + served.disk_reads >= (len(prompt) - 1) // BLOCK_SIZE  # it came back first
    second.cancel(handle)
    while not busy.done.is_set():
        second.step()
    assert second.scheduler.kv_cache.hot.pool.num_used_blocks() == 0
    second.stop()
    first.stop()
