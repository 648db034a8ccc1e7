"""What keeps the store within its bounds: LRU eviction over capacity, TTL expiry, and compaction.

Eviction and expiry only drop index entries; the bytes stay in their segments until the compactor
copies a mostly dead segment's live records to the active segment and deletes the file. Reads are
never blocked: an index entry is switched to its copy by compare-and-set once the copy is durable,
and a reader that still holds the old place finds the file gone and looks the key up again.

A record is judged dead by the index alone, so a stale index (Redis back from an older snapshot)
would have the compactor delete acknowledged blocks for good. It therefore runs only once the
store has checked the index (`RedisIndex.is_adopted`), every index read it makes refuses a stale
index (IndexStale ends the pass), and the index is checked once more right before each unlink.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from dataclasses import dataclass

from services.kvstore import kvstore_metrics as metrics
from services.kvstore.claims import PutInFlight
from services.kvstore.index import IndexLost
from services.kvstore.keys import StoreKey
from services.kvstore.record import Record
from services.kvstore.segments import list_segments, scan_segment, segment_path
from services.kvstore.store import BlockStore, now_us

log = logging.getLogger(__name__)
EVICTION_BATCH = 256


class SegmentBusy(Exception):
    """A put in flight is writing a key whose tombstone the segment holds: compact it later."""


@dataclass(frozen=True)
class CompactionResult:
    """What one compaction pass did."""

    num_segments: int
    num_moved_blocks: int
    reclaimed_bytes: int


class Compactor:
    """Eviction, expiry and compaction for one store; `start` runs them in the background."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        store.on_commit = self.evict_to_capacity
        self._evict_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        """Runs a maintenance pass every maintenance interval, and at once when a write found the
        disk full, until `stop`."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stops the background pass (a pass in flight is cancelled between records)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        # The flag, not only the cancel, ends the loop: a cancel that lands inside a Redis call can
        # come out as a connection error (UNAVAILABLE here), which the loop survives by design; the
        # process then hung on SIGTERM, its drain waiting for this task.
        while not self._stopping:
            await self._wait_for_pass()
            try:
                await self.run_pass()
            except Exception:  # the loop outlives one failed pass; the next interval tries again
                if self._stopping:
                    return
                log.exception("maintenance pass failed")
                metrics.ERRORS.labels("compact").inc()

    async def _wait_for_pass(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.store.config.maintenance_interval_s):
                await self.store.space_wanted.wait()
        self.store.space_wanted.clear()

    async def run_pass(self) -> None:
        """One maintenance pass: the capacity from the disk, eviction to it, expiry, compaction."""
        await self.store.refresh_capacity()
        await self.evict_to_capacity()
        await self.expire_idle()
        await self.compact()

    async def evict_to_capacity(self) -> int:
        """Drops least recently used blocks until live bytes are under the low watermark (the
        capacity read again from the disk first: it may have room again, or less)."""
        store, index = self.store, self.store.index
        live_bytes = (await store.guarded(index.totals)).live_bytes
        metrics.STORED_BYTES.set(live_bytes)
        if live_bytes <= store.capacity_bytes:
            return 0
        if live_bytes <= await store.refresh_capacity():
            return 0  # the disk has room again since the capacity was last read
        async with self._evict_lock:
            live_bytes, evicted = (await store.guarded(index.totals)).live_bytes, 0
            while live_bytes > store.low_watermark_bytes:
                victims = await store.guarded(lambda: index.least_recent(EVICTION_BATCH))
                if not victims:
                    break
                for key in victims:
                    removed = await self._drop(key)
                    live_bytes, evicted = live_bytes - removed, evicted + (removed > 0)
                    if live_bytes <= store.low_watermark_bytes:
                        break
            store.counters.evicted_blocks += evicted
            log.info("evicted %d blocks to stay under %d B", evicted, store.capacity_bytes)
            return evicted

    async def _drop(self, key: StoreKey) -> int:
        removed = await self.store.guarded(lambda: self.store.index.remove(key))
        self.store.staging.drop(key)  # after the entry is gone, as a delete does (BlockStore.prefetch)
        return removed

    async def expire_idle(self) -> int:
        """Drops blocks not read or written for the TTL."""
        if not self.store.config.ttl_s:
            return 0
        cutoff = now_us() - int(self.store.config.ttl_s * 1_000_000)
        expired = 0
        while keys := await self.store.guarded(lambda: self.store.index.idle_since(cutoff, EVICTION_BATCH)):
            for key in keys:
                expired += await self._drop(key) > 0  # _drop also clears an LRU member with no entry
        self.store.counters.expired_blocks += expired
        return expired

    async def compact(self) -> CompactionResult:
        """Rewrites every sealed segment whose live share is under the threshold; returns what it did."""
        store = self.store
        moved = reclaimed = done = 0
        async with store.maintenance_lock:
            if not store.index.is_adopted:
                return CompactionResult(0, 0, 0)  # the index is not checked yet: it could be stale
            try:
                live = await store.index.live_bytes_by_segment()
                for segment_id in list_segments(store.config.segments_dir):
                    if not self._is_candidate(segment_id, live.get(segment_id, 0)):
                        continue
                    size = segment_path(store.config.segments_dir, segment_id).stat().st_size
                    started = time.perf_counter()
                    try:
                        moved += await self._compact_segment(segment_id)
                    except SegmentBusy as busy:
                        log.info("segment %d is left for a later pass: %s", segment_id, busy)
                        continue
                    except OSError as error:
                        if error.errno != errno.ENOSPC:
                            raise
                        log.warning(
                            "the disk is too full to copy segment %d's live records; stopping", segment_id
                        )
                        break
                    metrics.OPERATION_DURATION.labels("compact").observe(time.perf_counter() - started)
                    reclaimed, done = reclaimed + size, done + 1
            except IndexLost as error:
                log.warning("compaction stops here and resumes after the index is rebuilt: %s", error)
        store.counters.compacted_segments += done
        return CompactionResult(done, moved, reclaimed)

    def _is_candidate(self, segment_id: int, live_bytes: int) -> bool:
        if segment_id >= self.store.writer.segment_id:
            return False  # the active segment (and any opened during this pass)
        if self.store.is_pinned(segment_id):
            return False  # a put in flight has records here with no index entry yet
        size = segment_path(self.store.config.segments_dir, segment_id).stat().st_size
        return live_bytes < self.store.config.compact_live_ratio * size

    async def _compact_segment(self, segment_id: int) -> int:
        """Copies the segment's live records (and the tombstones still needed), then deletes it."""
        store, directory = self.store, self.store.config.segments_dir
        is_oldest = list_segments(directory)[0] == segment_id
        scan = await asyncio.to_thread(scan_segment, directory, segment_id)
        copies, last_seq = [], 0
        for found in scan.records:
            record = found.record
            async with store.relocation_lock:  # a Delete's tombstone cannot slip in between
                (entry,) = await store.index.get_many([record.key])
                if record.is_tombstone:
                    # needed while older segments may hold the key's records, unless a later put superseded it
                    if not is_oldest and entry is None:
                        last_seq = await self._copy_tombstone(record)
                    continue
                if entry is None or entry.location != found.location:
                    continue  # dead: deleted, evicted, expired or superseded
                location, last_seq = await store.writer.append(record)
            copies.append((record.key, found.location, location))
        await store.writer.wait_durable(last_seq)
        for key, old, new in copies:
            await store.index.move(key, old, new)
        await store.index.check_current()  # the judgements above came from an index that still holds
        await store.index.forget_segment(segment_id)
        segment_path(directory, segment_id).unlink()
        log.info("compacted segment %d: %d live blocks moved", segment_id, len(copies))
        return len(copies)

    async def _copy_tombstone(self, tombstone: Record) -> int:
        """Appends a tombstone to the active segment, holding its key's claim meanwhile; returns
        its sequence number.

        A rebuild lets a key's last record in the files win, so the copy must land before any
        record of a put of that key: a put that claims the key while the copy is written waits,
        and then writes the block itself (claims.py). A key a put in flight claimed first may
        have its record written already, so the segment waits for a later pass (SegmentBusy).
        """
        claims = self.store.claims
        if claims.outcome(tombstone.key) is not None:
            raise SegmentBusy(f"a put of key {tombstone.key.hex()[:12]}… is in flight")
        holder = PutInFlight()
        claims.claim(holder, tombstone.key)
        try:
            _, seq = await self.store.writer.append(tombstone)
        finally:
            claims.settle(holder, tombstone.key, is_durable=False)  # absent: a waiting put writes it
        return seq
