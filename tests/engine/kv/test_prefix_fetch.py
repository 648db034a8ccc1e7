"""Prefix loads read from the kvstore's segment files (same-host reads), against a real kvstore
process over a real redis-server and real files.

A second replica with `local_reads` loads a stored prefix by LocateBlocks and its own reads, a
piece at a time, each piece written into its hot blocks while the next is read: the pages equal
what the first replica computed and the output equals a recompute, whatever the piece size. A record with a
flipped byte fails the engine's own check, goes to the GetBlocks stream, where the store refuses
it too: the prefix ends there and the rest is computed, so the bad bytes are never attended. A
store that hands out no locations costs nothing but the fast path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.kvstore_api import BlockHash, CallOptions, KVStoreClient, Namespace
from services.engine.config import EngineConfig
from services.engine.kv import prefix_fetch
from services.engine.kv.cold_tier import DEFAULT_TENANT, ColdTierConfig
from services.engine.kv.prefix_fetch import PrefixLayout
from services.engine.llm_engine import LLMEngine
from tests.conftest import holding_service_token
from tests.engine.kv.test_cold_tier import (
    BLOCK_SIZE,
    HEALTHY,
    degradations,
    degraded_events,
    kvstore,
    load_engine,
    long_prompt,
    prompt_block_hashes,
    run,
    store_prefix,
)
from tests.kvstore.conftest import KVStoreProcess, RedisServer

__all__ = ["kvstore"]  # the fixture of a store that hands out no locations


@pytest.fixture
def locating(tmp_path: Path) -> Iterator[KVStoreProcess]:
    """A kvstore that hands out record locations, over a redis-server of its own."""
    redis = RedisServer(tmp_path).start()
    env = {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"}
    process = KVStoreProcess(tmp_path / "kvstore", redis.url, env).start()
    with holding_service_token(process.service_token.path):  # the engine here calls as the engine
        yield process
    process.stop()
    redis.stop()


def local(store: KVStoreProcess) -> ColdTierConfig:
    return ColdTierConfig(target=store.target, local_reads=True, **HEALTHY)


def same_pages(first: LLMEngine, second: LLMEngine, prompt: list[int], num_blocks: int) -> bool:
    """The second replica's pages of the prompt's first blocks hold what the first one computed."""
    pages = []
    for engine in (first, second):
        cache = engine.runner.kv_cache
        ids = [cache.hot.pool._by_hash[h] for h in prompt_block_hashes(engine, prompt)[:num_blocks]]
        pages.append((cache.hot.keys[:, ids], cache.hot.values[:, ids]))
    (keys_a, values_a), (keys_b, values_b) = pages
    return torch.equal(keys_a, keys_b) and torch.equal(values_a, values_b)


# one block a piece; pieces that do not divide the 18-block prefix; the whole prefix in one piece
PIECES = [1, 4, prefix_fetch.PIECE_BLOCKS]


@pytest.mark.parametrize("piece_blocks", PIECES)
def test_a_prefix_read_from_the_segment_files_equals_a_recompute(
    stories_hf_dir: Path, locating: KVStoreProcess, monkeypatch: pytest.MonkeyPatch, piece_blocks: int
) -> None:
    monkeypatch.setattr(prefix_fetch, "PIECE_BLOCKS", piece_blocks)
    first = load_engine(stories_hf_dir, local(locating))
    prompt = long_prompt(first)
    store_prefix(first, prompt)
    plain = load_engine(stories_hf_dir, ColdTierConfig())  # no cold tier: computed in full
    recompute = run(plain, prompt).result()

    second = load_engine(stories_hf_dir, local(locating))
    collector = run(second, prompt)
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    stats = second.stats()
    assert stats.cold is not None and stats.cold.prefix_blocks_read_locally == num_blocks
    assert stats.cold.prompt_tokens_loaded == num_blocks * BLOCK_SIZE and stats.cold.degradations == 0
    assert stats.num_prefill_tokens_computed == len(prompt) - num_blocks * BLOCK_SIZE
    assert collector.result().token_ids == recompute.token_ids
    assert same_pages(first, second, prompt, num_blocks)
    with KVStoreClient(locating.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        served = client.stats()
    assert served.located_blocks >= num_blocks and served.disk_reads == 0  # no block came by the stream
    for engine in (first, plain, second):
        engine.stop()


@pytest.mark.parametrize("piece_blocks", PIECES)
def test_a_corrupt_record_falls_back_to_the_stream_and_is_never_attended(
    stories_hf_dir: Path, locating: KVStoreProcess, monkeypatch: pytest.MonkeyPatch, piece_blocks: int
) -> None:
    """Block 5 fails its check: with later pieces already read (pieces of 1 and 4), in flight or
    in the same piece, the prefix still ends exactly there."""
    monkeypatch.setattr(prefix_fetch, "PIECE_BLOCKS", piece_blocks)
    first = load_engine(stories_hf_dir, local(locating))
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    bad = BlockHash(prompt_block_hashes(first, prompt)[5].hex())
    with KVStoreClient(locating.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        (location,) = client.locate([bad])
    segment = Path(location.segment_path)
    data = bytearray(segment.read_bytes())
    data[location.offset + location.length - 7] ^= 0x01  # a payload byte of prompt block 5
    segment.write_bytes(bytes(data))
    before = degradations("load_prefix", "corrupt")

    second = load_engine(stories_hf_dir, local(locating))
    collector = run(second, prompt)
    stats = second.stats()
    assert collector.result().token_ids == expected.token_ids
    assert stats.cold is not None and stats.cold.prefix_blocks_read_locally == 5
    assert stats.cold.prompt_tokens_loaded == 5 * BLOCK_SIZE  # block 5 on was computed
    assert stats.num_prefill_tokens_computed == len(prompt) - 5 * BLOCK_SIZE
    assert degradations("load_prefix", "corrupt") == before + 1
    assert [e["thermocline.kv.reason"] for e in degraded_events(collector)] == ["corrupt"]
    assert same_pages(first, second, prompt, 5)
    with KVStoreClient(locating.target, Namespace(DEFAULT_TENANT, first.model_id)) as client:
        assert client.stats().corrupt_records == 1  # the stream's read found it too, and dropped it
    first.stop()
    second.stop()


def test_a_store_that_hands_out_no_locations_serves_the_prefix_by_the_stream(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    first = load_engine(stories_hf_dir, local(kvstore))
    prompt = long_prompt(first)
    expected = store_prefix(first, prompt)
    second = load_engine(stories_hf_dir, local(kvstore))
    collector = run(second, prompt)
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    stats = second.stats()
    assert collector.result().token_ids == expected.token_ids
    assert stats.cold is not None and stats.cold.prefix_blocks_read_locally == 0
    assert stats.cold.prompt_tokens_loaded == num_blocks * BLOCK_SIZE and stats.cold.degradations == 0
    assert second.cold is not None and not second.cold.tier._prefixes.local_reads
    first.stop()
    second.stop()


def test_local_reads_are_a_setting_and_off_by_default() -> None:
    assert not EngineConfig.from_env({}).cold.local_reads
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_KVSTORE_LOCAL_READS": "true"}).cold.local_reads


def test_a_prefix_layout_is_a_stored_prompt_block() -> None:
    layout = PrefixLayout((30, 2, 16, 3, 64))  # SmolLM2-135M: 368,640 B of BF16 per 16-token block
    assert layout.payload_bytes == 30 * 2 * 16 * 3 * 64 * 2


def test_the_pieces_of_one_load_share_one_lookup_deadline() -> None:
    """Each piece's LocateBlocks gets what is left of the load's deadline, not a deadline of its
    own: a slow store costs a 16-piece prefix one deadline, not sixteen."""
    call = CallOptions(timeout_s=1.0)
    now = time.monotonic()
    left = prefix_fetch._remaining(call, now - 0.4).timeout_s
    assert left is not None and 0.5 < left <= 0.6
    assert prefix_fetch._remaining(call, now - 5.0).timeout_s == 1e-3  # spent: fails at once
    assert prefix_fetch._remaining(CallOptions(), now - 5.0).timeout_s is None  # the client's default
