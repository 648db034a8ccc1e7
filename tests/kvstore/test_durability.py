"""Crashes: SIGKILL of the real kvstore mid-stream, and a torn record left at a segment's end."""

from __future__ import annotations

import threading

import grpc

from services.common.kvstore_api import FetchedBlock
from services.kvstore.blocks import Codec, MissReason
from services.kvstore.keys import Namespace, TenantSalts
from services.kvstore.record import Record
from services.kvstore.segments import list_segments, segment_path
from tests.kvstore.conftest import KVStoreProcess, RedisServer, raw_block

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
