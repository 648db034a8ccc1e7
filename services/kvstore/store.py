"""The block store: segment files for the bytes, Redis for the index, RAM staging for prefetches.

A put is `append` (the record is written) then `commit` (an fsync covers it, then the index
entry is added): a block is acknowledged only once it is durable, and is never visible before.
A read goes staging -> index -> segment and checks the record's checksum, key and place, so a
corrupt or torn record is a miss, never a served block. When the index is gone (Redis restarted
empty, FLUSHALL) or stale (Redis came back from an older snapshot: index.py says how that is
told), the next call that notices rebuilds it from the segments. No call uses the index before
the store has checked it at its first contact with Redis (`ensure_index`).

The engine reaches this class through the gRPC service; `services/kvstore/client.py` is its
client. State changes: append, commit, put (one put writes a key at a time: claims.py), delete,
prefetch (staging), get, lookup and locate (last access; a corrupt record's entry is dropped),
rebuild_index; eviction and compaction live in compactor.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import NamedTuple, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.kvstore import kvstore_metrics as metrics
from services.kvstore.blocks import BlockFound, BlockIn, BlockMissing, BlockSource, MissReason, check_block
from services.kvstore.capacity import disk_capacity_bytes, free_disk_bytes
from services.kvstore.claims import BlockWait, KeyClaims, PutInFlight, wait_outcomes
from services.kvstore.config import StoreConfig
from services.kvstore.dir_lock import DataDirLock
from services.kvstore.index import IndexEntry, IndexLost, IndexStale, RedisIndex
from services.kvstore.keys import BlockHash, Namespace, StoreKey, TenantSalts, check_hash
from services.kvstore.record import Record, RecordError
from services.kvstore.recovery import scan_live_entries
from services.kvstore.results import (
    BlockLocated,
    PendingWrite,
    PrefetchResult,
    PutResult,
    StoreCounters,
    StoreStats,
)
from services.kvstore.segments import (
    SegmentWriter,
    list_segments,
    read_record,
    segment_bytes,
    segment_path,
    segments_tail,
)
from services.kvstore.staging import Load, StagingCache

log = logging.getLogger(__name__)
T = TypeVar("T")
# Blocks a GetBlocks reads ahead of the one it is sending: reads (and their CRCs, on worker threads)
# overlap the replies instead of waiting for each to be sent.
READ_AHEAD_BLOCKS = 4
# How often the store PINGs Redis for its readiness, and how long an answer may take.
REDIS_PROBE_INTERVAL_S = 1.0
REDIS_PROBE_TIMEOUT_S = 2.0


def load_salts(config: StoreConfig) -> TenantSalts:
    """The store's tenant salts; SecretMissing when segments exist but their secret does not."""
    return TenantSalts.load_or_create(config.secret_path, may_create=not list_segments(config.segments_dir))


class PrefetchJob(NamedTuple):
    """One queued prefetch: the key, the entry its load reads, and the load it ends."""

    key: StoreKey
    entry: IndexEntry
    load: Load


def now_us() -> int:
    """Wall-clock microseconds: creation and last-access times survive restarts, and LRU order
    separates a read from the write just before it."""
    return time.time_ns() // 1000


class BlockStore:
    """One store: its segments, its index, its staging cache and its background workers."""

    def __init__(
        self,
        config: StoreConfig,
        index: RedisIndex,
        salts: TenantSalts,
        writer: SegmentWriter,
        opened_tail: str = "",
        dir_lock: DataDirLock | None = None,
    ) -> None:
        self.config = config
        self.dir_lock = dir_lock  # this process's hold on the data dir (dir_lock.py), released at close
        # where the segments ended before this store wrote anything: the index in Redis is taken
        # as current only if it can miss nothing up to here (RedisIndex.adopt)
        self.opened_tail = opened_tail
        self.index = index
        self.salts = salts
        self.writer = writer
        self.staging = StagingCache(config.staging_bytes)
        self.counters = StoreCounters()
        self.maintenance_lock = asyncio.Lock()  # rebuild and compaction never overlap
        self.relocation_lock = asyncio.Lock()  # a compactor's copy and a delete's tombstone keep their order
        self._prefetch_queue: asyncio.Queue[PrefetchJob] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False  # set by `close`: the workers end even where a cancel was swallowed
        self._touches: set[asyncio.Task[None]] = set()  # LRU updates of located blocks, in flight
        # set by the compactor: eviction after each commit
        self.on_commit: Callable[[], Awaitable[object]] | None = None
        self._puts: list[PutInFlight] = []  # between their first append and their end (`writing`)
        # live bytes kept before eviction: the configured capacity, or less where the disk holds
        # less (capacity.py); `refresh_capacity` sets it
        self.capacity_bytes = config.capacity_bytes
        self.space_wanted = asyncio.Event()  # a write found the disk full: the compactor runs a pass now
        # why the index (Redis) cannot be reached now, or None: readiness, from a PING each second
        self.index_problem: str | None = None
        self.claims = KeyClaims()  # keys puts in flight are writing (see claims.py)

    @classmethod
    async def open(cls, config: StoreConfig, dir_lock: DataDirLock | None = None) -> BlockStore:
        """Locks the data dir (unless the caller holds `dir_lock` already; DataDirLocked when
        another process has it), opens the segments and the index (rebuilding it when Redis lost
        it) and starts the workers. `close` releases the lock."""
        dir_lock = dir_lock or DataDirLock.acquire(config.data_dir)
        try:
            store = await cls._open_locked(config, dir_lock)
        except BaseException:
            dir_lock.release()
            raise
        return store

    @classmethod
    async def _open_locked(cls, config: StoreConfig, dir_lock: DataDirLock) -> BlockStore:
        client = aioredis.from_url(config.redis_url, socket_timeout=10, socket_connect_timeout=5)
        writer = SegmentWriter(
            config.segments_dir, config.max_segment_bytes, config.fsync_policy, config.fsync_batch_window_s
        )
        opened_tail = segments_tail(config.segments_dir)
        salts = load_salts(config)  # before a new segment is made: SecretMissing starts nothing
        await writer.open()
        store = cls(
            config,
            RedisIndex(client, config.index_prefix),
            salts,
            writer,
            opened_tail,
            dir_lock,
        )
        await store.refresh_capacity()
        try:
            await store.guarded(store.ensure_index)
        except Unavailable as error:  # serve anyway: calls say UNAVAILABLE, and rebuild once Redis is back
            log.error("starting without the index: %s", error.message)
        for _ in range(config.num_prefetch_workers):
            store._tasks.append(asyncio.create_task(store._prefetch_worker()))
        store._tasks.append(asyncio.create_task(store._watch_redis()))
        return store

    async def close(self) -> None:
        """Stops the workers, fsyncs and closes the active segment, and marks the index closed
        at the segments' tail (so the next start can trust a copy of it that Redis reloads)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.writer.close()
        await self._mark_closed()
        await self.index.client.aclose()
        if self.dir_lock is not None:
            self.dir_lock.release()

    async def _mark_closed(self) -> None:
        if not self.index.is_adopted:
            return
        try:
            await self.index.mark_closed(await asyncio.to_thread(segments_tail, self.config.segments_dir))
        except (IndexLost, RedisConnectionError, RedisTimeoutError) as error:  # the next start rebuilds
            log.warning("could not mark the index closed: %s", error)

    async def _watch_redis(self) -> None:
        """Keeps `index_problem` current, traffic or not: a router should move calls away while
        Redis is down (each would fail UNAVAILABLE), and back once it answers."""
        while not self._closing:
            try:
                async with asyncio.timeout(REDIS_PROBE_TIMEOUT_S):
                    await self.index.client.ping()
                self.index_problem = None
            except (RedisConnectionError, RedisTimeoutError, TimeoutError) as error:
                self.index_problem = f"its index (Redis) is unreachable: {error or 'no answer to PING'}"
            await asyncio.sleep(REDIS_PROBE_INTERVAL_S)

    # --- capacity and a full disk ------------------------------------------------------------

    async def refresh_capacity(self) -> int:
        """Sets the capacity in force from the configured one and the disk (capacity.py); returns it."""
        directory, config = self.config.segments_dir, self.config
        free, used = await asyncio.to_thread(lambda: (free_disk_bytes(directory), segment_bytes(directory)))
        disk = disk_capacity_bytes(free, used, config.max_segment_bytes, config.compact_live_ratio)
        capacity = min(config.capacity_bytes, disk)
        if capacity < config.capacity_bytes <= self.capacity_bytes:
            log.warning(
                "the disk holds less than THERMOCLINE_KVSTORE_CAPACITY_GB allows (%d B free, %d B in "
                "segments): the capacity is %d B until it has room again",
                free,
                used,
                capacity,
            )
        self.capacity_bytes = capacity
        metrics.CAPACITY_BYTES.set(capacity)
        return capacity

    @property
    def low_watermark_bytes(self) -> int:
        """Eviction runs down to here once live bytes pass the capacity, so it does not run every put."""
        return int(self.capacity_bytes * 0.9)

    @contextlib.contextmanager
    def disk_errors(self, operation: str) -> Iterator[None]:
        """A failed segment write or fsync is the store's fault, not the caller's: nothing was
        acknowledged. A full disk also starts a maintenance pass (eviction, then compaction)."""
        try:
            yield
        except OSError as error:
            metrics.ERRORS.labels(operation).inc()
            log.error("segment %s failed: %s", operation, error)
            if error.errno == errno.ENOSPC:
                self.space_wanted.set()
                raise ResourceExhausted(
                    f"the kvstore's disk is full, so this {operation} did nothing; the store is evicting "
                    "its least recently used blocks and compacting to make room: retry after a backoff"
                ) from error
            raise Unavailable(
                f"the kvstore cannot write its segments ({error.strerror}); nothing was stored"
            ) from error

    def key(self, namespace: Namespace, block_hash: str) -> StoreKey:
        """The salted store key of a caller's hash (the hash is checked first)."""
        return self.salts.key(namespace, check_hash(block_hash))

    def check_hashes(self, block_hashes: list[str]) -> list[BlockHash]:
        """A call's hashes, checked, and not more than a call may name."""
        if len(block_hashes) > self.config.max_hashes_per_call:
            raise InvalidArgument(
                f"{len(block_hashes)} hashes in one call; the limit is {self.config.max_hashes_per_call} "
                "(THERMOCLINE_KVSTORE_MAX_HASHES): split the call"
            )
        return [check_hash(h) for h in block_hashes]

    # --- the index, guarded -------------------------------------------------------------------

    async def guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs an index call: the index is checked first (once), a lost or stale index is rebuilt
        and the call retried; Redis down is UNAVAILABLE."""
        try:
            try:
                await self.ensure_index()
                return await call()
            except IndexLost as error:
                if isinstance(error, IndexStale):
                    log.error("the index in Redis is stale; rebuilding it from the segments: %s", error)
                await self.rebuild_index()
                return await call()
        except (RedisConnectionError, RedisTimeoutError) as error:
            self.index_problem = f"its index (Redis) is unreachable: {error}"
            raise Unavailable(
                f"the kvstore's index (Redis) is unreachable: {error}; the cold tier is down, so callers "
                "should fall back to their hot and warm tiers"
            ) from error

    async def ensure_index(self) -> None:
        """At the store's first contact with Redis: takes the index there as current if it can
        miss nothing (RedisIndex.adopt), else rebuilds it from the segments."""
        if self.index.is_adopted:
            return
        async with self.maintenance_lock:
            if self.index.is_adopted:
                return  # another call took it while this one waited
            if not await self.index.adopt(self.opened_tail):
                log.warning("the index in Redis is missing or may be older than the segments")
                await self._rebuild()

    async def rebuild_index(self) -> None:
        """Scans every segment (writes paused) and replaces the index with what it finds."""
        async with self.maintenance_lock:
            if self.index.is_adopted and await self.index.is_current():
                return  # another call rebuilt it while this one waited
            await self._rebuild()

    async def _rebuild(self) -> None:
        async with self.writer.paused():
            started = time.perf_counter()
            entries, num_corrupt = await asyncio.to_thread(
                scan_live_entries, self.config.segments_dir, self.config.ttl_s, now_us()
            )
            self.counters.corrupt_records += num_corrupt
            await self.index.rebuild(entries)
            self.counters.index_rebuilds += 1
            log.warning(
                "index rebuilt from %d segments: %d blocks in %.2f s",
                len(list_segments(self.config.segments_dir)),
                len(entries),
                time.perf_counter() - started,
            )

    # --- writes -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self) -> Iterator[PutInFlight]:
        """Hold this around a put, from its first `append` to its `commit` (or its failure), and
        pass what it yields to each `append`.

        A put's records get their index entries only at the commit, after its last block, so until
        then they look dead to the compactor, and a long put's first records lie in segments that
        rotation has sealed meanwhile. The compactor leaves every segment that holds a record of a
        put in flight with no index entry yet, or may be taking one now (`is_pinned`): only those,
        so a put stream that idles pins nothing it has not written. The keys the put writes are
        its own until its commit settles them; a put that fails or is cancelled settles them as
        failed here, so puts waiting on them write those blocks themselves (claims.py).
        """
        put = PutInFlight()
        self._puts.append(put)
        try:
            yield put
        finally:
            self.claims.settle_all(put, is_durable=False)
            self._puts.remove(put)

    def is_pinned(self, segment_id: int) -> bool:
        """Whether a put in flight has, or may be writing, a record in the segment that the index
        does not hold yet (the compactor must leave it)."""
        for put in self._puts:
            if put.appending_from is not None and segment_id >= put.appending_from:
                return True
            if any(write.entry.location.segment_id == segment_id for write in put.pending):
                return True
        return False

    async def append(self, put: PutInFlight, namespace: Namespace, block: BlockIn) -> None:
        """Writes one block's record for `put` (from `writing`); `commit(put)` makes it durable.

        Writes nothing when the block is stored already or `put` names it twice (a duplicate), or
        when another put in flight is writing it: `commit` then waits for that put's outcome and
        writes the block only if that put failed (claims.py says why one key gets one record).
        """
        check_block(block, self.config.max_block_bytes)
        key = self.key(namespace, block.block_hash)
        outcome = self.claims.outcome(key)
        if key in put.claimed:  # its first copy commits with this put
            put.result.duplicates.append(block.block_hash)
        elif outcome is not None:
            put.waits.append(BlockWait(namespace, block, outcome))
        else:
            await self._append_claimed(put, namespace, block, key)

    async def _append_claimed(
        self, put: PutInFlight, namespace: Namespace, block: BlockIn, key: StoreKey
    ) -> None:
        self.claims.claim(put, key)
        (existing,) = await self.guarded(lambda: self.index.get_many([key]))
        if existing is not None:
            self.claims.settle(put, key, is_durable=True)
            put.result.duplicates.append(block.block_hash)
            return
        created = now_us()
        record = Record(
            key,
            namespace.tenant,
            namespace.model,
            block.block_hash,
            block.codec,
            block.shape,
            block.payload,
            created,
        )
        put.appending_from = self.writer.segment_id  # pinned from here until it is pending
        try:
            with self.disk_errors("put"):
                location, seq = await self.writer.append(record)
        finally:
            put.appending_from = None
        entry = IndexEntry(location, block.codec, namespace.tenant, created)
        put.pending.append(PendingWrite(block.block_hash, key, entry, seq))

    async def commit(self, put: PutInFlight) -> PutResult:
        """Makes `put`'s records durable and indexes them; then, for each block another put was
        writing, waits for that put's outcome: a duplicate if it committed the block, else written
        and committed by this put. Returns what was stored and what was present (and durable)."""
        while True:
            await self._commit_pending(put)
            if not put.waits:
                break
            await self._append_after_waits(put)
        if put.result.stored:
            await self.after_commit()
        return put.result

    async def _commit_pending(self, put: PutInFlight) -> None:
        """Waits until the put's records are durable, indexes them, and settles their claims; they
        stay pending (their segments pinned) until all are indexed."""
        pending = put.pending
        if not pending:
            return
        with self.disk_errors("put"):
            await self.writer.wait_durable(max(p.seq for p in pending))
        for write in pending:
            is_new = await self.guarded(lambda write=write: self.index.add(write.key, write.entry))  # type: ignore[misc]
            (put.result.stored if is_new or await self._is_ours(write) else put.result.duplicates).append(
                write.block_hash
            )
            metrics.WRITTEN_BYTES.inc(write.entry.location.length if is_new else 0)
            self.claims.settle(put, write.key, is_durable=True)
        put.pending = []

    async def _append_after_waits(self, put: PutInFlight) -> None:
        """Waits, holding no claim, for the puts writing `put`'s remaining blocks; appends the
        blocks whose put failed (each may find yet another put writing it, and wait again)."""
        assert not put.claimed, "a put that waits while it holds a claim can deadlock with another"
        waits, put.waits = put.waits, []
        for wait, is_durable in zip(waits, await wait_outcomes(waits), strict=True):
            if is_durable:
                put.result.duplicates.append(wait.block.block_hash)
            else:
                await self.append(put, wait.namespace, wait.block)

    async def _is_ours(self, write: PendingWrite) -> bool:
        """After a rebuild the index may already hold this very record: then it is stored, not a duplicate."""
        (entry,) = await self.guarded(lambda: self.index.get_many([write.key]))
        return entry is not None and entry.location == write.entry.location

    async def after_commit(self) -> None:
        """Runs the compactor's eviction, so a put returns with the store under its capacity."""
        if self.on_commit is not None:
            await self.on_commit()

    async def put(self, namespace: Namespace, blocks: list[BlockIn]) -> PutResult:
        """Stores blocks; returns once the stored ones, and the duplicates, are durable."""
        with self.writing() as put:
            for block in blocks:
                await self.append(put, namespace, block)
            return await self.commit(put)

    async def delete(self, namespace: Namespace, block_hashes: list[str]) -> int:
        """Deletes blocks; returns how many were present. Each gets a tombstone, so a rebuild
        cannot bring it back; the reply waits until the tombstones are durable."""
        hashes = self.check_hashes(block_hashes)
        keys = [self.key(namespace, h) for h in hashes]
        return await self.guarded(lambda: self._delete(namespace, hashes, keys))

    async def _delete(self, namespace: Namespace, hashes: list[BlockHash], keys: list[StoreKey]) -> int:
        entries = await self.index.get_many(keys)
        seq = deleted = 0
        removed: list[tuple[StoreKey, IndexEntry]] = []
        try:
            for key, block_hash, entry in zip(keys, hashes, entries, strict=True):
                if entry is None:
                    continue
                tombstone = Record(
                    key, namespace.tenant, namespace.model, block_hash, entry.codec, (), b"", now_us()
                )
                async with self.relocation_lock:  # the compactor cannot copy the record past its tombstone
                    with self.disk_errors("delete"):
                        _, seq = await self.writer.append(tombstone.tombstone(now_us()))
                    if await self.index.remove(key) > 0:
                        deleted += 1
                        removed.append((key, entry))
                    self.staging.drop(key)  # after the entry is gone: see `prefetch`
            with self.disk_errors("delete"):
                await self.writer.wait_durable(seq)
        except BaseException:
            # Tombstones that are not durable: a rebuild could bring their blocks back, so the
            # entries return and a retry of the delete finds them and writes its own tombstones.
            # An entry a put has added since stays (`add` leaves a present key alone).
            try:
                for key, entry in removed:
                    await self.index.add(key, entry)
            except Exception:  # the index itself failed (Redis gone): its rebuild reads the segments
                log.warning("could not restore %d index entries after a failed delete", len(removed))
            raise
        return deleted

    # --- reads --------------------------------------------------------------------------------

    async def live_entries(self, keys: list[StoreKey]) -> list[IndexEntry | None]:
        """Index entries, with entries idle past the TTL dropped (and counted as expired)."""
        entries = await self.guarded(lambda: self.index.get_many(keys))
        if not self.config.ttl_s:
            return entries
        cutoff = now_us() - int(self.config.ttl_s * 1_000_000)
        for position, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            if entry is not None and entry.access_us < cutoff:
                entries[position] = None
                await self.drop_entry(key, entry)
                self.counters.expired_blocks += 1
        return entries

    async def drop_entry(self, key: StoreKey, entry: IndexEntry) -> int:
        """Removes an entry if it still points where `entry` says; then unstages the key (see `prefetch`)."""
        removed = await self.guarded(lambda: self.index.remove(key, expected=entry.location))
        self.staging.drop(key)
        return removed

    async def lookup(self, namespace: Namespace, block_hashes: list[str]) -> list[BlockHash]:
        """The hashes that are stored, in request order, without reading them."""
        hashes = self.check_hashes(block_hashes)
        entries = await self.live_entries([self.key(namespace, h) for h in hashes])
        present = [h for h, e in zip(hashes, entries, strict=True) if e is not None]
        metrics.BLOCK_LOOKUPS.labels("hit").inc(len(present))
        metrics.BLOCK_LOOKUPS.labels("miss").inc(len(hashes) - len(present))
        return present

    async def locate(self, namespace: Namespace, block_hashes: list[str]) -> list[BlockLocated]:
        """Where the present blocks' records lie, in request order, for a caller on this host that
        reads the segment files itself (and checks each record's CRC, which covers its place).

        Keys are salted with the caller's tenant exactly as for `get`, so a namespace locates its own
        blocks only. A location can go stale (compaction moves the record, a delete drops it); the
        caller then reads a file that is gone or bytes that fail its checks, and asks `get` instead.
        """
        if not self.config.serve_locations:
            raise FailedPrecondition(
                "this kvstore does not hand out record locations; set "
                "THERMOCLINE_KVSTORE_SERVE_LOCATIONS=true where the engine shares its host and data dir, "
                "or read blocks with GetBlocks"
            )
        hashes = self.check_hashes(block_hashes)
        keys = [self.key(namespace, h) for h in hashes]
        entries = await self.live_entries(keys)
        directory = self.config.segments_dir.resolve()
        present = [(h, e) for h, e in zip(hashes, entries, strict=True) if e is not None]
        # a long prefix spans a few segments: one path each, not one per block
        paths = {seg: segment_path(directory, seg) for seg in {e.location.segment_id for _, e in present}}
        located = [BlockLocated(h, e.codec, paths[e.location.segment_id], e.location) for h, e in present]
        metrics.BLOCK_LOOKUPS.labels("hit").inc(len(located))
        metrics.BLOCK_LOOKUPS.labels("miss").inc(len(hashes) - len(located))
        self.counters.located_blocks += len(located)
        touched = [k for k, e in zip(keys, entries, strict=True) if e is not None]
        self._touch_later(touched)
        return located

    def _touch_later(self, keys: list[StoreKey]) -> None:
        """Mark keys used off the reply's path (a long prefix is thousands of keys; LRU order can wait)."""
        task = asyncio.create_task(self.guarded(lambda: self.index.touch(keys, now_us())))
        self._touches.add(task)
        task.add_done_callback(self._touched)

    def _touched(self, task: asyncio.Task[None]) -> None:
        self._touches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("marking located blocks used failed: %s", task.exception())

    async def get(
        self, namespace: Namespace, block_hashes: list[str]
    ) -> AsyncIterator[BlockFound | BlockMissing]:
        """Each requested block in order: from staging when there, else from disk; misses say why."""
        hashes = self.check_hashes(block_hashes)
        keys = [self.key(namespace, h) for h in hashes]
        unstaged = [k for k in keys if k not in self.staging and k not in self.staging.loading]
        entries: dict[StoreKey, IndexEntry | None] = {}
        if unstaged:
            entries = dict(zip(unstaged, await self.live_entries(unstaged), strict=True))
        served: list[StoreKey] = []
        reads: deque[asyncio.Task[BlockFound | BlockMissing]] = deque()
        try:
            for block_hash, key in zip(hashes, keys, strict=True):
                reads.append(asyncio.ensure_future(self._get_one(block_hash, key, entries)))
                if len(reads) > READ_AHEAD_BLOCKS:
                    yield await self._served(reads.popleft(), served)
            while reads:
                yield await self._served(reads.popleft(), served)
        finally:
            for read in reads:  # the caller went away mid-stream
                read.cancel()
        try:  # best effort: every block is sent, and a stale LRU order costs less than a failed call
            await self.guarded(lambda: self.index.touch(served, now_us()))
        except Unavailable as error:
            log.warning("marking %d served blocks used failed: %s", len(served), error.message)

    async def _served(
        self, read: asyncio.Task[BlockFound | BlockMissing], served: list[StoreKey]
    ) -> BlockFound | BlockMissing:
        outcome = await read
        metrics.BLOCK_LOOKUPS.labels("hit" if isinstance(outcome, BlockFound) else "miss").inc()
        if isinstance(outcome, BlockFound):
            served.append(outcome.record.key)
        return outcome

    async def _get_one(
        self, block_hash: BlockHash, key: StoreKey, entries: dict[StoreKey, IndexEntry | None]
    ) -> BlockFound | BlockMissing:
        staged = self.staging.get(key)
        if staged is None and key in self.staging.loading:
            staged = await asyncio.shield(self.staging.loading[key])  # its prefetch is in flight
        if staged is not None:
            self.counters.staging_hits += 1
            return BlockFound(block_hash, staged, BlockSource.STAGING)
        if key not in entries:  # it was staged when the call began, and has left staging since
            (entries[key],) = await self.live_entries([key])
        entry = entries[key]
        if entry is None:
            return BlockMissing(block_hash, MissReason.ABSENT)
        outcome = await self.read(key, entry)
        if isinstance(outcome, Record):
            self.counters.disk_reads += 1
            return BlockFound(block_hash, outcome, BlockSource.DISK)
        return BlockMissing(block_hash, outcome)

    async def read(self, key: StoreKey, entry: IndexEntry) -> Record | MissReason:
        """The record an entry points at, checked; a corrupt one is dropped from the index."""
        started = time.perf_counter()
        try:
            record = await read_record(self.config.segments_dir, entry.location)
        except FileNotFoundError:  # compacted away since the lookup: its entry has moved
            (moved,) = await self.guarded(lambda: self.index.get_many([key]))
            return MissReason.ABSENT if moved is None or moved == entry else await self.read(key, moved)
        except (RecordError, OSError) as error:
            return await self._corrupt(key, entry, str(error))
        if record.key != key or record.is_tombstone:
            return await self._corrupt(key, entry, "the index points at another block's record")
        metrics.READ_BYTES.inc(entry.location.length)
        metrics.OPERATION_DURATION.labels("get").observe(time.perf_counter() - started)
        return record

    async def _corrupt(self, key: StoreKey, entry: IndexEntry, reason: str) -> MissReason:
        log.error(
            "block %s… at %s is unreadable, served as a miss: %s", key.hex()[:12], entry.location, reason
        )
        metrics.ERRORS.labels("get").inc()
        self.counters.corrupt_records += 1
        await self.drop_entry(key, entry)
        return MissReason.CORRUPT

    # --- prefetch -----------------------------------------------------------------------------

    async def prefetch(self, namespace: Namespace, block_hashes: list[str]) -> PrefetchResult:
        """Queues the present, unstaged blocks for loading into RAM; returns at once.

        Each load begins before its index entry is read, and a delete removes the entry before it
        drops the key from staging: a delete either ends the load (`StagingCache.drop`) or came
        first and left no entry to load, so no load stages a block after its delete returned.
        """
        keys = [self.key(namespace, h) for h in self.check_hashes(block_hashes)]
        already = sum(1 for k in keys if k in self.staging or k in self.staging.loading)
        loads = {k: load for k in dict.fromkeys(keys) if (load := self.staging.begin_load(k)) is not None}
        try:
            entries = await self.live_entries(list(loads)) if loads else []
        except BaseException:
            for key, load in loads.items():
                self.staging.end_load(key, load, None)
            raise
        queued = 0
        for (key, load), entry in zip(loads.items(), entries, strict=True):
            if entry is None:
                self.staging.end_load(key, load, None)
            else:
                self._prefetch_queue.put_nowait(PrefetchJob(key, entry, load))
                queued += 1
        return PrefetchResult(queued, already)

    async def _prefetch_worker(self) -> None:
        # `_closing`, not only the cancel, ends the loop: a cancel landing in a Redis call can come
        # out as a connection error, which the worker would survive and `close` then wait on forever
        while not self._closing:
            job = await self._prefetch_queue.get()
            if job.load.done():
                continue  # dropped while it waited its turn
            try:
                outcome = await self.read(job.key, job.entry)
                self.staging.end_load(job.key, job.load, outcome if isinstance(outcome, Record) else None)
            except Exception:  # a worker outlives any one failed load
                self.staging.end_load(job.key, job.load, None)
                if self._closing:
                    return
                log.exception("prefetch of %s… failed", job.key.hex()[:12])

    # --- stats --------------------------------------------------------------------------------

    async def stats(self) -> StoreStats:
        """Occupancy from the index and the disk, and the counters."""
        totals = await self.guarded(self.index.totals)
        segments_dir = self.config.segments_dir
        disk_bytes = await asyncio.to_thread(segment_bytes, segments_dir)
        metrics.STORED_BYTES.set(totals.live_bytes)
        return StoreStats(
            num_blocks=totals.num_blocks,
            used_bytes=totals.live_bytes,
            capacity_bytes=self.capacity_bytes,
            staged_blocks=len(self.staging),
            staged_bytes=self.staging.num_bytes,
            disk_bytes=disk_bytes,
            num_segments=len(list_segments(segments_dir)),
            counters=self.counters,
        )
