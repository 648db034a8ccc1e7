"""The block index in Redis: store key -> segment, offset, length, codec, tenant, last access.

Keys, under the configured prefix `P`:
    P b:<key hex>   hash: seg, off, len, codec, tenant, access_us
    P lru           sorted set: key hex scored by last access (µs); LRU eviction and TTL read it
    P seglive       hash: segment id -> live bytes in it; the compactor picks segments by it
    P meta          hash: num_blocks, live_bytes; its absence means the index is empty or lost

Every mutation is one Lua script, so the counters never drift from the entries even when
Redis is shared. A script that finds `meta` missing raises `IndexLost`; the store then rebuilds
the index from its segments (Redis restarted empty, or someone ran FLUSHALL).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from services.kvstore.keys import StoreKey
from services.kvstore.segments import Location

_ADD = """
if redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'seg', ARGV[2], 'off', ARGV[3], 'len', ARGV[4], 'codec', ARGV[5],
           'tenant', ARGV[6], 'access_us', ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[7], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[2], ARGV[4])
redis.call('HINCRBY', KEYS[4], 'live_bytes', ARGV[4])
redis.call('HINCRBY', KEYS[4], 'num_blocks', 1)
return 1
"""
_REMOVE = """
if redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
local entry = redis.call('HMGET', KEYS[1], 'seg', 'off', 'len')
if not entry[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])  -- an LRU member without an entry must not stall eviction
  return 0
end
if ARGV[2] ~= '' and (entry[1] ~= ARGV[2] or entry[2] ~= ARGV[3]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], entry[1], -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[4], 'live_bytes', -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[4], 'num_blocks', -1)
return tonumber(entry[3])
"""
_MOVE = """
local entry = redis.call('HMGET', KEYS[1], 'seg', 'off', 'len')
if entry[1] ~= ARGV[1] or entry[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'seg', ARGV[3], 'off', ARGV[4], 'len', ARGV[5])
redis.call('HINCRBY', KEYS[2], ARGV[1], -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[2], ARGV[3], tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[3], 'live_bytes', tonumber(ARGV[5]) - tonumber(entry[3]))
return 1
"""
# Reads and touches of many entries are one script each, not one command per key: redis-py spends
# about 50-100 us of Python per pipelined command, which made a 2,047-block LocateBlocks (a 32K
# prefix) take 150 ms; as one script it is one command and one reply.
_GET_MANY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local entries = {}
for i = 2, #KEYS do
  entries[i - 1] = redis.call('HMGET', KEYS[i], 'seg', 'off', 'len', 'codec', 'tenant', 'access_us')
end
return entries
"""
_TOUCH = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then  -- an entry removed meanwhile stays removed
    redis.call('HSET', KEYS[i], 'access_us', ARGV[1])
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
  end
end
return 0
"""
_FIELDS = ("seg", "off", "len", "codec", "tenant", "access_us")
REBUILD_BATCH = 1000


class IndexLost(Exception):
    """The index's marker is gone: Redis lost its data, and the store must rebuild it."""


@dataclass(frozen=True)
class IndexEntry:
    """What the index holds for one block."""

    location: Location
    codec: int
    tenant: str
    access_us: int


@dataclass(frozen=True)
class IndexTotals:
    """Counts over every entry."""

    num_blocks: int
    live_bytes: int


class RedisIndex:
    """The index of one store, under one key prefix. Mutators: add, remove, move, touch, rebuild."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._lru, self._seglive, self._meta = prefix + "lru", prefix + "seglive", prefix + "meta"
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)
        self._move = client.register_script(_MOVE)
        self._get_many = client.register_script(_GET_MANY)
        self._touch = client.register_script(_TOUCH)

    def _entry_key(self, key: StoreKey) -> str:
        return f"{self.prefix}b:{key.hex()}"

    async def is_built(self) -> bool:
        """Whether the index holds a complete view (its marker exists)."""
        return bool(await self.client.exists(self._meta))

    async def add(self, key: StoreKey, entry: IndexEntry) -> bool:
        """Adds an entry; False when the key is present already."""
        loc = entry.location
        args: list[str | int] = [
            key.hex(),
            loc.segment_id,
            loc.offset,
            loc.length,
            int(entry.codec),
            entry.tenant,
            entry.access_us,
        ]
        result = await self._add(keys=[self._entry_key(key), self._lru, self._seglive, self._meta], args=args)
        if result == -1:
            raise IndexLost("the index marker is missing")
        return bool(result == 1)

    async def remove(self, key: StoreKey, expected: Location | None = None) -> int:
        """Drops an entry (only if it still points at `expected`, when given); returns its bytes, else 0."""
        place = [expected.segment_id, expected.offset] if expected else ["", ""]
        keys = [self._entry_key(key), self._lru, self._seglive, self._meta]
        result = int(await self._remove(keys=keys, args=[key.hex(), *place]))
        if result == -1:
            raise IndexLost("the index marker is missing")
        return result

    async def move(self, key: StoreKey, old: Location, new: Location) -> bool:
        """Points an entry at its copy, if it still points at `old` (the compactor's compare-and-set)."""
        args = [old.segment_id, old.offset, new.segment_id, new.offset, new.length]
        return bool(await self._move(keys=[self._entry_key(key), self._seglive, self._meta], args=args))

    async def get_many(self, keys: list[StoreKey]) -> list[IndexEntry | None]:
        """The entries of `keys`, None where absent; IndexLost when the index is gone."""
        replies = await self._get_many(keys=[self._meta, *(self._entry_key(key) for key in keys)])
        if replies == -1:
            raise IndexLost("the index marker is missing")
        return [_entry(reply) for reply in replies]

    async def touch(self, keys: Iterable[StoreKey], now_us: int) -> None:
        """Marks entries as just used (LRU order and TTL)."""
        keys = list(keys)
        if keys:
            entry_keys = [self._entry_key(key) for key in keys]
            await self._touch(keys=[self._lru, *entry_keys], args=[now_us, *(key.hex() for key in keys)])

    async def least_recent(self, count: int) -> list[StoreKey]:
        """Up to `count` keys, least recently used first."""
        members = await self.client.zrange(self._lru, 0, count - 1)
        return [StoreKey(bytes.fromhex(_text(m))) for m in members]

    async def idle_since(self, cutoff_us: int, count: int) -> list[StoreKey]:
        """Up to `count` keys last used before `cutoff_us`."""
        members = await self.client.zrangebyscore(self._lru, "-inf", f"({cutoff_us}", start=0, num=count)
        return [StoreKey(bytes.fromhex(_text(m))) for m in members]

    async def totals(self) -> IndexTotals:
        """Blocks and live bytes."""
        num_blocks, live_bytes = await self.client.hmget(self._meta, ["num_blocks", "live_bytes"])
        return IndexTotals(int(num_blocks or 0), int(live_bytes or 0))

    async def live_bytes_by_segment(self) -> dict[int, int]:
        """Live bytes in each segment that holds any."""
        raw = cast(dict[Any, Any], await self.client.hgetall(self._seglive))
        return {int(_text(seg)): int(num_bytes) for seg, num_bytes in raw.items()}

    async def forget_segment(self, segment_id: int) -> None:
        """Drops a compacted segment's counter."""
        await self.client.hdel(self._seglive, str(segment_id))

    async def rebuild(self, entries: dict[StoreKey, IndexEntry]) -> None:
        """Replaces the whole index with `entries`; the marker is written last."""
        await self.client.delete(self._meta)
        async for stale in self.client.scan_iter(match=f"{self.prefix}*", count=REBUILD_BATCH):
            await self.client.delete(stale)
        items = list(entries.items())
        for start in range(0, len(items), REBUILD_BATCH):
            async with self.client.pipeline(transaction=False) as pipe:
                for key, entry in items[start : start + REBUILD_BATCH]:
                    _write_entry(pipe, self._entry_key(key), key, entry, self._lru, self._seglive)
                await pipe.execute()
        live_bytes = sum(e.location.length for e in entries.values())
        await self.client.hset(self._meta, mapping={"num_blocks": len(entries), "live_bytes": live_bytes})


def _write_entry(pipe: Any, entry_key: str, key: StoreKey, entry: IndexEntry, lru: str, seglive: str) -> None:
    loc = entry.location
    fields = {"seg": loc.segment_id, "off": loc.offset, "len": loc.length}
    pipe.hset(
        entry_key,
        mapping=fields | {"codec": int(entry.codec), "tenant": entry.tenant, "access_us": entry.access_us},
    )
    pipe.zadd(lru, {key.hex(): entry.access_us})
    pipe.hincrby(seglive, str(loc.segment_id), loc.length)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry(reply: list[Any]) -> IndexEntry | None:
    if reply[0] is None:
        return None
    seg, off, length, codec, tenant, access_us = reply
    return IndexEntry(Location(int(seg), int(off), int(length)), int(codec), _text(tenant), int(access_us))
