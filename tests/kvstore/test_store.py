"""The block store's puts, on a BlockStore in this process over a real Redis and real files: one key
has one record, and a duplicate is durable when the put returns."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from services.common.errors import Unavailable
from services.kvstore.blocks import BlockFound, BlockIn
from services.kvstore.keys import BlockHash, Namespace
from services.kvstore.segments import list_segments, scan_segment
from services.kvstore.store import BlockStore
from tests.kvstore.conftest import STARTUP_TIMEOUT_S, HeldCall, RedisServer, eio, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")
T = TypeVar("T")


async def served_payload(store: BlockStore, block_hash: BlockHash) -> bytes | None:
    """The payload a get serves for one block; None on a miss."""
    (outcome,) = [o async for o in store.get(NAMESPACE, [block_hash])]
    return outcome.record.payload if isinstance(outcome, BlockFound) else None


def records_of(store: BlockStore, block_hash: BlockHash) -> int:
    """How many records of the block the segments hold."""
    directory = store.config.segments_dir
    scans = [scan_segment(directory, segment_id) for segment_id in list_segments(directory)]
    return sum(found.record.block_hash == block_hash for scan in scans for found in scan.records)


def other_bytes(block: BlockIn) -> BlockIn:
    """The same hash with other bytes, so the test sees whose record is served."""
    return BlockIn(block.block_hash, block.codec, block.shape, block.payload[::-1])


async def bounded(call: Awaitable[T]) -> T:
    """`call`, failed after STARTUP_TIMEOUT_S: a put that deadlocks fails its test instead of hanging it."""
    return await asyncio.wait_for(call, STARTUP_TIMEOUT_S)


def test_concurrent_puts_of_one_absent_block_write_one_record_that_a_rebuild_keeps(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two puts of one hash with different bytes, neither stored yet: one stores it, the other
    is a duplicate and writes nothing, so a rebuild from the segments serves what the index did."""

    async def scenario(store: BlockStore) -> None:
        first = raw_block("one-hash")
        second = other_bytes(first)
        results = await asyncio.gather(store.put(NAMESPACE, [first]), store.put(NAMESPACE, [second]))
        assert sorted((r.stored, r.duplicates) for r in results) == [
            ([], [first.block_hash]),
            ([first.block_hash], []),
        ]
        winner = first if results[0].stored else second
        assert await served_payload(store, first.block_hash) == winner.payload
        assert records_of(store, first.block_hash) == 1
        await store.index.client.flushall()  # the next call rebuilds the index from the segments
        assert await served_payload(store, first.block_hash) == winner.payload
        assert store.counters.index_rebuilds == 2  # at open (empty Redis), and after the flush

    # the second put's index check lands inside the first one's fsync window, before its commit
    run_store(tmp_path, redis_server, scenario, fsync_batch_window_s=0.05)


def test_a_put_waiting_on_another_put_of_its_block_writes_it_when_that_put_fails(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first put of a hash fails at its fsync (EIO) while a second put of that hash waits on it:
    the second writes the block itself, reports it stored, and its bytes are served, before and
    after a rebuild. (Before the fix the second was told "duplicate" and the block was absent.)"""

    async def scenario(store: BlockStore) -> None:
        first = raw_block("one-hash")
        second = other_bytes(first)
        fsync = HeldCall(os.fsync, eio())
        monkeypatch.setattr(os, "fsync", fsync)
        failing = asyncio.ensure_future(store.put(NAMESPACE, [first]))
        await fsync.wait_entered()  # its record is written and its key claimed; its fsync is held
        with store.writing() as put:
            await store.append(put, NAMESPACE, second)
            assert len(put.waits) == 1 and not put.pending  # it saw the claim and wrote nothing
            committing = asyncio.ensure_future(store.commit(put))
            fsync.release.set()
            with pytest.raises(Unavailable):
                await failing
            result = await bounded(committing)
        assert (result.stored, result.duplicates) == ([first.block_hash], [])
        assert await served_payload(store, first.block_hash) == second.payload
        await store.index.client.flushall()  # the failed record may be in the files: it must not win
        assert await served_payload(store, first.block_hash) == second.payload

    run_store(tmp_path, redis_server, scenario)


def test_a_put_waiting_on_a_cancelled_put_of_its_block_writes_it(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first put's caller goes away while its fsync runs: its claim is settled as failed, so a
    second put waiting on it writes the block. The cancelled record still becomes durable (the fsync
    is not cut short), but it lies before the second's, so a rebuild serves the second's too."""

    async def scenario(store: BlockStore) -> None:
        first = raw_block("one-hash")
        second = other_bytes(first)
        fsync = HeldCall(os.fsync)
        monkeypatch.setattr(os, "fsync", fsync)
        cancelled = asyncio.ensure_future(store.put(NAMESPACE, [first]))
        await fsync.wait_entered()
        with store.writing() as put:
            await store.append(put, NAMESPACE, second)
            assert len(put.waits) == 1 and not put.pending
            committing = asyncio.ensure_future(store.commit(put))
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            fsync.release.set()
            result = await bounded(committing)
        assert (result.stored, result.duplicates) == ([first.block_hash], [])
        assert await served_payload(store, first.block_hash) == second.payload
        await store.index.client.flushall()
        assert await served_payload(store, first.block_hash) == second.payload

    run_store(tmp_path, redis_server, scenario)


def test_puts_naming_the_same_blocks_in_opposite_orders_both_complete(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Each put claims its first block before the other reaches it, so each then finds the other
    writing a block it names: neither may wait while it holds its own claims. Each block is stored
    by one put, a duplicate to the other, and has one record."""

    async def scenario(store: BlockStore) -> None:
        blocks = [raw_block(f"shared-{n}") for n in range(3)]
        forward = store.put(NAMESPACE, blocks)
        backward = store.put(NAMESPACE, [other_bytes(b) for b in reversed(blocks)])
        results = await bounded(asyncio.gather(forward, backward))
        for block in blocks:
            (storer,) = [n for n, r in enumerate(results) if block.block_hash in r.stored]
            assert block.block_hash in results[1 - storer].duplicates
            assert records_of(store, block.block_hash) == 1
            stored_bytes = block if storer == 0 else other_bytes(block)
            assert await served_payload(store, block.block_hash) == stored_bytes.payload

    run_store(tmp_path, redis_server, scenario)


def test_a_put_naming_one_block_twice_stores_it_once(tmp_path: Path, redis_server: RedisServer) -> None:
    """The second copy is a duplicate of the first, which commits with the same put: the put does
    not wait on its own claim."""

    async def scenario(store: BlockStore) -> None:
        block = raw_block("named-twice")
        result = await bounded(store.put(NAMESPACE, [block, other_bytes(block)]))
        assert (result.stored, result.duplicates) == ([block.block_hash], [block.block_hash])
        assert records_of(store, block.block_hash) == 1
        assert await served_payload(store, block.block_hash) == block.payload

    run_store(tmp_path, redis_server, scenario)


def test_a_get_whose_blocks_were_all_sent_ends_well_when_marking_them_used_fails(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Marking the served blocks used (LRU order) comes after the last block is sent; Redis lost
    then must not turn the whole call into a failure, which makes the caller drop every block."""

    async def scenario(store: BlockStore) -> None:
        blocks = [raw_block(f"block-{n}") for n in range(3)]
        await store.put(NAMESPACE, blocks)
        outcomes = store.get(NAMESPACE, [b.block_hash for b in blocks])
        served = [await anext(outcomes) for _ in blocks]
        assert [o.record.payload for o in served if isinstance(o, BlockFound)] == [b.payload for b in blocks]
        await asyncio.to_thread(redis_server.stop)
        with pytest.raises(StopAsyncIteration):
            await anext(outcomes)

    run_store(tmp_path, redis_server, scenario)
