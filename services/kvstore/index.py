"""The block index in Redis: store key -> segment, offset, length, codec, tenant, last access.

Keys, under the configured prefix `P`:
    P b:<key hex>   hash: seg, off, len, codec, tenant, access_us
    P lru           sorted set: key hex scored by last access (µs); LRU eviction and TTL read it
    P seglive       hash: segment id -> live bytes in it; the compactor picks segments by it
    P meta          hash: num_blocks, live_bytes, and what says whether the index is current:
                    generation, version, redis_run_id, closed_tail (below); its absence means the
                    index is empty or lost

Every mutation is one Lua script, so the counters never drift from the entries even when
Redis is shared. A script that finds `meta` missing raises `IndexLost`; the store then rebuilds
the index from its segments (Redis restarted empty, or someone ran FLUSHALL).

Redis can also come back holding an older copy of the index (a restart that loads an RDB
snapshot or an AOF that lags): `meta` is there, but acknowledged puts and deletes are not. Two
checks catch that, and the store then rebuilds as for a lost index:
- While the store runs: each rebuild draws a new `generation`, and every mutation bumps
  `version` and hands it back. Every script is called with the generation and the highest
  version this store has seen, and refuses (`IndexStale`) when Redis holds another generation or
  an older version: it has lost mutations that were acknowledged.
- At start (no version seen yet): Redis is trusted when it is the very process
  (`redis_run_id`, INFO's run_id) that held the index while the last store ran, since a running
  Redis loses nothing; or when the segments end exactly where the last store to close cleanly
  left them (`closed_tail`, written after its last record): then no record was written since
  that copy of the index, so it misses nothing. Otherwise it is rebuilt.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from services.kvstore.keys import StoreKey
from services.kvstore.segments import Location

# Every checked script has `meta` as KEYS[1] and the generation and least version as ARGV[1..2].
# -1: the index is lost; -2: it is stale (another generation, or an older version).
_CHECK = """
local marker = redis.call('HMGET', KEYS[1], 'generation', 'version')
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if marker[1] ~= ARGV[1] or tonumber(marker[2]) < tonumber(ARGV[2]) then return -2 end
local seen = tonumber(marker[2])
"""
_ADD = (
    _CHECK
    + """
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, seen} end
redis.call('HSET', KEYS[2], 'seg', ARGV[4], 'off', ARGV[5], 'len', ARGV[6], 'codec', ARGV[7],
           'tenant', ARGV[8], 'access_us', ARGV[9])
redis.call('ZADD', KEYS[3], ARGV[9], ARGV[3])
redis.call('HINCRBY', KEYS[4], ARGV[4], ARGV[6])
redis.call('HINCRBY', KEYS[1], 'live_bytes', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'num_blocks', 1)
return {1, redis.call('HINCRBY', KEYS[1], 'version', 1)}
"""
)
_REMOVE = (
    _CHECK
    + """
local entry = redis.call('HMGET', KEYS[2], 'seg', 'off', 'len')
if not entry[1] then
  redis.call('ZREM', KEYS[3], ARGV[3])  -- an LRU member without an entry must not stall eviction
  return {0, seen}
end
if ARGV[4] ~= '' and (entry[1] ~= ARGV[4] or entry[2] ~= ARGV[5]) then return {0, seen} end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('HINCRBY', KEYS[4], entry[1], -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[1], 'live_bytes', -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[1], 'num_blocks', -1)
return {tonumber(entry[3]), redis.call('HINCRBY', KEYS[1], 'version', 1)}
"""
)
_MOVE = (
    _CHECK
    + """
local entry = redis.call('HMGET', KEYS[2], 'seg', 'off', 'len')
if entry[1] ~= ARGV[3] or entry[2] ~= ARGV[4] then return {0, seen} end
redis.call('HSET', KEYS[2], 'seg', ARGV[5], 'off', ARGV[6], 'len', ARGV[7])
redis.call('HINCRBY', KEYS[3], ARGV[3], -tonumber(entry[3]))
redis.call('HINCRBY', KEYS[3], ARGV[5], tonumber(ARGV[7]))
redis.call('HINCRBY', KEYS[1], 'live_bytes', tonumber(ARGV[7]) - tonumber(entry[3]))
return {1, redis.call('HINCRBY', KEYS[1], 'version', 1)}
"""
)
# Reads and touches of many entries are one script each, not one command per key: redis-py spends
# about 50-100 us of Python per pipelined command, which made a 2,047-block LocateBlocks (a 32K
# prefix) take 150 ms; as one script it is one command and one reply.
_GET_MANY = (
    _CHECK
    + """
local entries = {}
for i = 2, #KEYS do
  entries[i - 1] = redis.call('HMGET', KEYS[i], 'seg', 'off', 'len', 'codec', 'tenant', 'access_us')
end
return entries
"""
)
_TOUCH = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then  -- an entry removed meanwhile stays removed
    redis.call('HSET', KEYS[i], 'access_us', ARGV[1])
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
  end
end
return 0
"""
_IS_CURRENT = _CHECK + "return 0\n"
_MARK_CLOSED = _CHECK + "redis.call('HSET', KEYS[1], 'closed_tail', ARGV[3])\nreturn 0\n"
_FIELDS = ("seg", "off", "len", "codec", "tenant", "access_us")
REBUILD_BATCH = 1000
_LOST, _STALE = -1, -2


class IndexLost(Exception):
    """The index's marker is gone: Redis lost its data, and the store must rebuild it."""


class IndexStale(IndexLost):
    """Redis holds an older copy of the index (it came back from a snapshot): it lacks mutations
    that were acknowledged, so the store must rebuild it as if it were lost."""


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
    """The index of one store, under one key prefix. Mutators: add, remove, move, touch, rebuild,
    adopt, mark_closed.

    It remembers the generation it adopted or built and the highest version a mutation handed
    back (`seen_version`); every checked script refuses an index older than that (`IndexStale`).
    Until `adopt` or `rebuild` has run (`is_adopted`), every checked script refuses.
    """

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._lru, self._seglive, self._meta = prefix + "lru", prefix + "seglive", prefix + "meta"
        self.generation: str | None = None
        self.seen_version = 0
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)
        self._move = client.register_script(_MOVE)
        self._get_many = client.register_script(_GET_MANY)
        self._touch = client.register_script(_TOUCH)
        self._is_current = client.register_script(_IS_CURRENT)
        self._mark_closed = client.register_script(_MARK_CLOSED)

    def _entry_key(self, key: StoreKey) -> str:
        return f"{self.prefix}b:{key.hex()}"

    @property
    def is_adopted(self) -> bool:
        """Whether this store has taken the index in Redis as current, or built it."""
        return self.generation is not None

    def _marker(self) -> list[str | int]:
        return [self.generation or "", self.seen_version]

    def _checked(self, reply: Any) -> Any:
        if reply == _LOST:
            raise IndexLost("the index marker is missing")
        if reply == _STALE:
            raise IndexStale(
                f"Redis holds an older index than this store wrote (generation {self.generation}, "
                f"version {self.seen_version} seen)"
            )
        return reply

    def _mutated(self, reply: Any) -> int:
        result, version = self._checked(reply)
        self.seen_version = max(self.seen_version, int(version))
        return int(result)

    async def check_current(self) -> None:
        """Returns when the index is this store's and holds every mutation it has seen; else
        IndexLost or IndexStale."""
        self._checked(await self._is_current(keys=[self._meta], args=self._marker()))

    async def is_current(self) -> bool:
        """Whether `check_current` passes."""
        try:
            await self.check_current()
        except IndexLost:
            return False
        return True

    async def redis_run_id(self) -> str:
        """The id of the Redis process: a new one at each restart of Redis."""
        info = cast(dict[str, Any], await self.client.info("server"))
        return str(info["run_id"])

    async def adopt(self, tail: str) -> bool:
        """Takes the index in Redis as current if it can miss nothing (module docstring); False
        when it must be rebuilt. `tail` is where the segments end (`segments.segments_tail`)."""
        fields = ["generation", "version", "redis_run_id", "closed_tail"]
        generation, version, run_id, closed_tail = await self.client.hmget(self._meta, fields)
        if generation is None:  # lost, or written before indexes had generations
            return False
        current_run_id = await self.redis_run_id()
        if _text(run_id or "") != current_run_id and _text(closed_tail or "") != tail:
            return False  # Redis restarted since, with a copy older than the segments
        await self.client.hset(self._meta, "redis_run_id", current_run_id)
        self.generation, self.seen_version = _text(generation), int(version or 0)
        return True

    async def mark_closed(self, tail: str) -> None:
        """Records that the store closed with its segments ending at `tail` and the index
        holding every record up to there (unless the index is no longer current)."""
        self._checked(await self._mark_closed(keys=[self._meta], args=[*self._marker(), tail]))

    async def add(self, key: StoreKey, entry: IndexEntry) -> bool:
        """Adds an entry; False when the key is present already."""
        loc = entry.location
        args: list[str | int] = [
            *self._marker(),
            key.hex(),
            loc.segment_id,
            loc.offset,
            loc.length,
            int(entry.codec),
            entry.tenant,
            entry.access_us,
        ]
        keys = [self._meta, self._entry_key(key), self._lru, self._seglive]
        return self._mutated(await self._add(keys=keys, args=args)) == 1

    async def remove(self, key: StoreKey, expected: Location | None = None) -> int:
        """Drops an entry (only if it still points at `expected`, when given); returns its bytes, else 0."""
        place = [expected.segment_id, expected.offset] if expected else ["", ""]
        keys = [self._meta, self._entry_key(key), self._lru, self._seglive]
        return self._mutated(await self._remove(keys=keys, args=[*self._marker(), key.hex(), *place]))

    async def move(self, key: StoreKey, old: Location, new: Location) -> bool:
        """Points an entry at its copy, if it still points at `old` (the compactor's compare-and-set)."""
        args = [*self._marker(), old.segment_id, old.offset, new.segment_id, new.offset, new.length]
        keys = [self._meta, self._entry_key(key), self._seglive]
        return self._mutated(await self._move(keys=keys, args=args)) == 1

    async def get_many(self, keys: list[StoreKey]) -> list[IndexEntry | None]:
        """The entries of `keys`, None where absent; IndexLost when the index is gone, IndexStale
        when it is older than this store's."""
        entry_keys = [self._entry_key(key) for key in keys]
        replies = self._checked(await self._get_many(keys=[self._meta, *entry_keys], args=self._marker()))
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
        """Replaces the whole index with `entries` under a new generation; the marker is written last."""
        await self.client.delete(self._meta)
        stale: list[Any] = []  # deleted a batch per command: one command per key took 8 s of 13 at 40K
        async for key in self.client.scan_iter(match=f"{self.prefix}*", count=REBUILD_BATCH):
            stale.append(key)
            if len(stale) == REBUILD_BATCH:
                await self.client.unlink(*stale)
                stale.clear()
        if stale:
            await self.client.unlink(*stale)
        items = list(entries.items())
        for start in range(0, len(items), REBUILD_BATCH):
            async with self.client.pipeline(transaction=False) as pipe:
                for key, entry in items[start : start + REBUILD_BATCH]:
                    _write_entry(pipe, self._entry_key(key), key, entry, self._lru, self._seglive)
                await pipe.execute()
        generation = secrets.token_hex(8)
        live_bytes = sum(e.location.length for e in entries.values())
        run_id = await self.redis_run_id()
        await self.client.hset(
            self._meta,
            mapping={
                "num_blocks": len(entries),
                "live_bytes": live_bytes,
                "generation": generation,
                "version": 0,
                "redis_run_id": run_id,
            },
        )
        self.generation, self.seen_version = generation, 0


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
