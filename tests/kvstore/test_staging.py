"""The RAM staging cache: bounded in bytes, least recently used out first."""

from __future__ import annotations

import asyncio

from services.kvstore.keys import BlockHash, StoreKey
from services.kvstore.record import Record
from services.kvstore.staging import StagingCache


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
        assert cache.begin_load(key) and not cache.begin_load(key)  # a second prefetch is not queued
        waiter = asyncio.ensure_future(asyncio.shield(cache.loading[key]))
        cache.end_load(key, record)
        assert await waiter is record and cache.get(key) is record and not cache.loading

    asyncio.run(scenario())
