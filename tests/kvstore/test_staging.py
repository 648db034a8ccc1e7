"""The RAM staging cache: bounded in bytes, least recently used out first; a dropped key's load in
flight stages nothing (alone, and in a real store whose prefetch races a delete or an expiry)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from services.kvstore.blocks import BlockMissing, MissReason
from services.kvstore.compactor import Compactor
from services.kvstore.keys import BlockHash, Namespace, StoreKey
from services.kvstore.record import Record
from services.kvstore.staging import StagingCache
from services.kvstore.store import BlockStore, now_us
from tests.kvstore.conftest import HeldCall, RedisServer, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")


def staged(name: str, num_bytes: int) -> tuple[StoreKey, Record]:
    """A key and a record of `num_bytes` payload."""
    key = StoreKey(name.encode().ljust(32, b"\0"))
    return key, Record(key, "t", "m", BlockHash("ab" * 8), 1, (1,), b"x" * num_bytes, 0)


def test_staging_stays_within_its_budget_and_evicts_the_least_recent() -> None:
    cache = StagingCache(max_bytes=300)
    blocks = [staged(f"b{n}", 100) for n in range(3)]
    for key, record in blocks:
        cache.put(key, record)
    assert cache.get(blocks[0][0]) is not None  # b0 is now the most recent
    cache.put(*staged("b3", 100))
    assert blocks[1][0] not in cache and blocks[0][0] in cache and blocks[2][0] in cache
    assert cache.num_bytes == 300 and len(cache) == 3
    cache.put(*staged("huge", 301))  # larger than the whole budget: not staged, nothing evicted
    assert len(cache) == 3 and cache.num_bytes == 300


def test_a_load_in_flight_is_shared_and_stages_its_record() -> None:
    async def scenario() -> None:
        cache = StagingCache(max_bytes=1000)
        key, record = staged("b0", 100)
        load = cache.begin_load(key)
        assert load is not None and cache.begin_load(key) is None  # a second prefetch is not queued
        waiter = asyncio.ensure_future(asyncio.shield(cache.loading[key]))
        cache.end_load(key, load, record)
        assert await waiter is record and cache.get(key) is record and not cache.loading

    asyncio.run(scenario())


def test_a_load_dropped_in_flight_stages_nothing_and_a_new_load_is_its_own() -> None:
    async def scenario() -> None:
        cache = StagingCache(max_bytes=1000)
        key, record = staged("b0", 100)
        dropped = cache.begin_load(key)
        assert dropped is not None
        cache.drop(key)  # deleted while its read was in flight
        assert await dropped is None and not cache.loading
        fresh = cache.begin_load(key)  # a prefetch after the drop
        assert fresh is not None
        cache.end_load(key, dropped, record)  # the dropped read returns: it neither stages nor ends `fresh`
        assert key not in cache and cache.loading[key] is fresh and not fresh.done()

    asyncio.run(scenario())


Drop = Callable[[BlockStore, BlockHash], Awaitable[None]]


async def drop_by_delete(store: BlockStore, block_hash: BlockHash) -> None:
    """Delete, as the RPC does."""
    assert await store.delete(NAMESPACE, [block_hash]) == 1


async def drop_by_expiry(store: BlockStore, block_hash: BlockHash) -> None:
    """The maintenance pass's TTL expiry (an eviction drops a key the same way)."""
    two_hours_ago = now_us() - 2 * 3600 * 1_000_000
    await store.index.touch([store.key(NAMESPACE, block_hash)], two_hours_ago)
    assert await Compactor(store).expire_idle() == 1


@pytest.mark.parametrize("drop", [drop_by_delete, drop_by_expiry])
def test_a_block_dropped_while_its_prefetch_reads_it_is_never_served(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, drop: Drop
) -> None:
    """The prefetch worker's read of the record is held at the OS boundary (os.pread) while the
    block is dropped; the read then returns the record, still intact on disk."""

    async def scenario(store: BlockStore) -> None:
        dropped, other = raw_block("dropped-mid-prefetch"), raw_block("prefetched-after-it")
        await store.put(NAMESPACE, [dropped, other])
        pread = HeldCall(os.pread)
        monkeypatch.setattr(os, "pread", pread)
        assert (await store.prefetch(NAMESPACE, [dropped.block_hash, other.block_hash])).queued == 2
        other_load = store.staging.loading[store.key(NAMESPACE, other.block_hash)]
        await pread.wait_entered()  # the one worker is reading `dropped`'s record
        await drop(store, dropped.block_hash)
        pread.release.set()
        assert await other_load is not None  # one worker, in order: `dropped`'s load has ended too
        served = [outcome async for outcome in store.get(NAMESPACE, [dropped.block_hash])]
        assert served == [BlockMissing(dropped.block_hash, MissReason.ABSENT)]
        assert len(store.staging) == 1 and store.staging.num_bytes == len(other.payload)

    run_store(tmp_path, redis_server, scenario, num_prefetch_workers=1, ttl_s=3600.0)
