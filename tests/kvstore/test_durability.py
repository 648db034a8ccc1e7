"""Crashes and disk faults: SIGKILL of the real kvstore mid-stream, a torn record left at a
segment's end, a write cut short by the file size limit, and an fsync that fails."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import threading
from pathlib import Path

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.kvstore_api import FetchedBlock
from services.kvstore.blocks import Codec, MissReason
from services.kvstore.keys import Namespace, TenantSalts
from services.kvstore.record import Record
from services.kvstore.segments import list_segments, segment_path
from services.kvstore.store import BlockStore
from tests.kvstore.conftest import HeldCall, KVStoreProcess, RedisServer, eio, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")
NUM_WRITERS = 4
ACKS_BEFORE_KILL = 40


class Writers:
    """Threads that each put blocks one small stream at a time, recording what was acknowledged."""

    def __init__(self, kvstore: KVStoreProcess) -> None:
        self.kvstore = kvstore
        self.attempted: dict[str, str] = {}  # hash -> block name
        self.acked: set[str] = set()
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._write, args=(n,)) for n in range(NUM_WRITERS)]

    def _write(self, worker: int) -> None:
        with self.kvstore.client() as client:
            for n in range(10_000):
                blocks = [raw_block(f"w{worker}-{n}-{part}") for part in range(3)]
                with self.changed:
                    self.attempted |= {b.block_hash: f"w{worker}-{n}-{part}" for part, b in enumerate(blocks)}
                try:
                    stored = client.put(blocks).stored
                except grpc.RpcError:
                    return  # the server is gone
                with self.changed:
                    self.acked.update(stored)
                    self.changed.notify_all()

    def run_until_acked(self, num_acked: int) -> None:
        """Starts the writers and returns once `num_acked` blocks are acknowledged."""
        for thread in self.threads:
            thread.start()
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.acked) >= num_acked, timeout=120), "writes stalled"

    def join(self) -> None:
        """Waits for every writer to notice the server is gone."""
        for thread in self.threads:
            thread.join(60)


def check_intact(kvstore: KVStoreProcess, writers: Writers) -> dict[str, FetchedBlock | MissReason]:
    """Every acknowledged block reads back with its bytes; nothing served is torn."""
    with kvstore.client() as client:
        fetched = client.get(sorted(writers.attempted))
    missing = [h for h in writers.acked if not isinstance(fetched[h], FetchedBlock)]
    assert not missing, f"{len(missing)} acknowledged blocks lost, e.g. {writers.attempted[missing[0]]}"
    for served_hash, got in fetched.items():
        if isinstance(got, FetchedBlock):
            assert got.payload == raw_block(writers.attempted[served_hash]).payload, served_hash
    return fetched


def test_sigkill_during_writes_loses_no_acknowledged_block(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    writers = Writers(kvstore)
    writers.run_until_acked(ACKS_BEFORE_KILL)
    kvstore.kill()
    writers.join()
    assert len(writers.attempted) > len(writers.acked)  # the kill did land mid-stream
    kvstore.start()
    check_intact(kvstore, writers)
    # and again with the index rebuilt from the segments alone, torn tails included
    redis_server.client().flushall()
    check_intact(kvstore, writers)
    with kvstore.client() as client:
        assert client.stats().index_rebuilds >= 1


def test_a_torn_record_at_a_segment_end_is_never_served(
    kvstore: KVStoreProcess, redis_server: RedisServer
) -> None:
    blocks = [raw_block(f"kept-{n}") for n in range(4)]
    with kvstore.client() as client:
        client.put(blocks)
    kvstore.stop()
    # what a crash halfway through a write leaves: the first half of a valid record
    salts = TenantSalts((kvstore.data_dir / "tenant_secret").read_bytes())
    namespace = Namespace("tenant-a", "tiny-llama")
    torn = raw_block("torn")
    key = salts.key(namespace, torn.block_hash)
    newest = segment_path(kvstore.data_dir / "segments", list_segments(kvstore.data_dir / "segments")[-1])
    offset = newest.stat().st_size
    record = Record(
        key, namespace.tenant, namespace.model, torn.block_hash, Codec.RAW, torn.shape, torn.payload, 1
    )
    with newest.open("ab") as file:
        file.write(record.encode(int(newest.stem), offset)[:3000])
    redis_server.client().flushall()
    kvstore.start()
    with kvstore.client() as client:
        fetched = client.get([torn.block_hash] + [b.block_hash for b in blocks])
        stats = client.stats()
    assert fetched[torn.block_hash] is MissReason.ABSENT
    assert all(isinstance(fetched[b.block_hash], FetchedBlock) for b in blocks)
    assert stats.corrupt_records >= 1  # the scan found the torn bytes and skipped them


def newest_segment(kvstore: KVStoreProcess) -> Path:
    """The active segment's file (the newest on disk)."""
    directory = kvstore.data_dir / "segments"
    return segment_path(directory, list_segments(directory)[-1])


def test_a_short_write_fails_its_put_and_leaves_the_segment_as_it_was(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A real short write: RLIMIT_FSIZE on the kvstore process stops a record partway (as a full
    disk does), then is lifted. Later puts go to the same segment and must read back intact."""
    kvstore = KVStoreProcess(tmp_path / "kvstore", redis_server.url).start()  # 256 MiB: no rotation
    assert kvstore.process is not None
    try:
        with kvstore.client() as client:
            before = raw_block("before-the-short-write")
            client.put([before])
            segment = newest_segment(kvstore)
            size = segment.stat().st_size
            unlimited = resource.prlimit(kvstore.process.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(kvstore.process.pid, resource.RLIMIT_FSIZE, (size + 100, unlimited[1]))
            with pytest.raises(grpc.RpcError) as refused:
                client.put([raw_block("cut-short")])
            resource.prlimit(kvstore.process.pid, resource.RLIMIT_FSIZE, unlimited)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert segment.stat().st_size == size  # no torn bytes left behind
            after = [raw_block(f"after-the-short-write-{n}") for n in range(3)]
            assert sorted(client.put(after).stored) == sorted(b.block_hash for b in after)
            assert newest_segment(kvstore) == segment  # the same segment took them
            hashes = [before.block_hash, raw_block("cut-short").block_hash] + [b.block_hash for b in after]
            fetched = client.get(hashes)
            assert fetched[raw_block("cut-short").block_hash] is MissReason.ABSENT
            for block in [before, *after]:
                got = fetched[block.block_hash]
                assert isinstance(got, FetchedBlock) and got.payload == block.payload, got
            redis_server.client().flushall()  # and a rebuild from the segments finds them too
            rebuilt = client.get(hashes)
            assert all(isinstance(rebuilt[b.block_hash], FetchedBlock) for b in [before, *after])
            assert client.stats().corrupt_records == 0
    finally:
        kvstore.stop()


def test_a_failed_fsync_fails_the_puts_it_covered_and_seals_the_segment(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync fails once with EIO (at the OS boundary; Linux may then report the next fsync of that
    file a success though the dirty pages are gone): no put whose record it covered is acknowledged,
    a record written while it ran is lost too, and the segment takes nothing more."""

    async def scenario(store: BlockStore) -> None:
        before = raw_block("durable-before")
        await store.put(NAMESPACE, [before])
        fsync = HeldCall(os.fsync, eio())
        monkeypatch.setattr(os, "fsync", fsync)
        covered = asyncio.ensure_future(store.put(NAMESPACE, [raw_block("covered-by-the-failed-fsync")]))
        await fsync.wait_entered()
        with store.writing() as put:
            await store.append(put, NAMESPACE, raw_block("written-while-it-ran"))
            (during,) = put.pending
            fsync.release.set()
            with pytest.raises(Unavailable):
                await covered
            with pytest.raises(Unavailable):  # a second fsync would "succeed": it must not be asked
                await store.commit(put)
        after = raw_block("after")
        assert (await store.put(NAMESPACE, [after])).stored == [after.block_hash]
        failed_segment = during.entry.location.segment_id
        (after_entry,) = await store.index.get_many([store.key(NAMESPACE, after.block_hash)])
        assert after_entry is not None and after_entry.location.segment_id > failed_segment
        hashes = [before.block_hash, raw_block("covered-by-the-failed-fsync").block_hash]
        hashes += [raw_block("written-while-it-ran").block_hash, after.block_hash]
        assert await store.lookup(NAMESPACE, hashes) == [before.block_hash, after.block_hash]

    run_store(tmp_path, redis_server, scenario)


def test_a_delete_whose_tombstone_fsync_fails_is_refused_and_a_retry_deletes_for_good(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tombstone is not durable, so the block keeps its index entry: a retry finds it and writes
    a tombstone of its own, and a rebuild from the segments then leaves the block deleted."""

    async def scenario(store: BlockStore) -> None:
        block = raw_block("deleted-twice")
        await store.put(NAMESPACE, [block])
        monkeypatch.setattr(os, "fsync", failing := HeldCall(os.fsync, eio()))
        failing.release.set()  # fails at once
        with pytest.raises(Unavailable):
            await store.delete(NAMESPACE, [block.block_hash])
        assert await store.lookup(NAMESPACE, [block.block_hash]) == [block.block_hash]
        assert await store.delete(NAMESPACE, [block.block_hash]) == 1  # the retry finds it
        await store.index.client.flushall()  # a rebuild from the segments: the tombstone holds
        assert await store.lookup(NAMESPACE, [block.block_hash]) == []

    run_store(tmp_path, redis_server, scenario)


def test_a_lost_tenant_secret_is_not_silently_replaced(kvstore: KVStoreProcess) -> None:
    """Every stored key derives from the secret: a new one would make every block unreachable
    while the store looked healthy. With segments there, the store refuses to start and says how
    to mend it; with none, a fresh one is made."""
    with kvstore.client() as client:
        client.put([raw_block("keyed-with-the-old-secret")])
    kvstore.stop()
    (kvstore.data_dir / "tenant_secret").unlink()
    exit_code = kvstore.start_or_exit()
    if exit_code is None:
        kvstore.stop()
    assert exit_code not in (None, 0)
    assert "restore it from the backup of this data dir" in kvstore.log_tail()
    shutil.rmtree(kvstore.data_dir / "segments")  # the operator starts empty instead
    kvstore.start()
    assert (kvstore.data_dir / "tenant_secret").stat().st_size == 32
