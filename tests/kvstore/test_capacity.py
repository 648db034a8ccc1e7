"""A disk smaller than the configured capacity, or filled by something else: the store keeps what
the disk can hold (eviction runs), a full disk costs a put RESOURCE_EXHAUSTED and starts the
eviction and compaction its message promises, and a store restarted on a full disk serves reads
and refuses writes until there is room."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.kvstore_api import FetchedBlock, KVStoreClient
from services.kvstore.blocks import BlockIn
from services.kvstore.capacity import disk_capacity_bytes
from tests.kvstore.conftest import (
    KVStoreProcess,
    RedisServer,
    fill_disk,
    raw_block,
    wait_until,
)

DISK_BYTES = 2 * 1024 * 1024  # small_disk's size
BLOCK_VALUES = 10_000  # a 20 KB payload
# 64 KiB segments; the configured capacity (64 GiB) is far above the disk's
SETTINGS = {"THERMOCLINE_KVSTORE_SEGMENT_MB": "0.0625", "THERMOCLINE_KVSTORE_MAINTENANCE_S": "3600"}


@pytest.fixture
def kvstore_on_small_disk(
    small_disk: Path, tmp_path: Path, redis_server: RedisServer
) -> Iterator[KVStoreProcess]:
    """A kvstore whose data dir is on the small disk (its log is not)."""
    process = KVStoreProcess(small_disk / "kvstore", redis_server.url, SETTINGS, log_dir=tmp_path)
    yield process.start()
    process.stop()


def put_when_there_is_room(client: KVStoreClient, block: BlockIn, full: list[str]) -> bool:
    """One put; False when the disk was full (its message kept in `full`)."""
    try:
        return client.put([block]).stored == [block.block_hash]
    except grpc.RpcError as error:
        if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        full.append(error.details())
        return False


def test_capacity_follows_the_disk_so_puts_keep_being_stored(kvstore_on_small_disk: KVStoreProcess) -> None:
    """Three disks' worth of puts on a disk far smaller than the configured capacity: eviction
    keeps the store within what the disk holds (a put that still finds it full is refused, and
    the eviction and compaction it starts make room for the retry)."""
    blocks = [raw_block(f"block-{n}", BLOCK_VALUES) for n in range(3 * DISK_BYTES // (2 * BLOCK_VALUES))]
    full: list[str] = []
    with kvstore_on_small_disk.client() as client:
        for block in blocks:
            wait_until(lambda block=block: put_when_there_is_room(client, block, full), "room for a put", 30)
        stats = client.stats()
        newest = client.get([b.block_hash for b in blocks[-5:]])
    assert stats.capacity_bytes < DISK_BYTES / 2 and stats.evicted_blocks > 0
    assert stats.used_bytes <= stats.capacity_bytes
    assert all(isinstance(got, FetchedBlock) for got in newest.values())
    assert all("evicting" in message for message in full), full


def test_a_store_restarted_on_a_full_disk_serves_reads_and_refuses_writes_until_there_is_room(
    kvstore_on_small_disk: KVStoreProcess, small_disk: Path
) -> None:
    kvstore = kvstore_on_small_disk
    blocks = [raw_block(f"kept-{n}", BLOCK_VALUES) for n in range(4)]
    with kvstore.client() as client:
        client.put(blocks)
    kvstore.stop()
    filler = small_disk / "filler"
    fill_disk(filler)  # something else fills the disk while the store is down
    kvstore.start()
    with kvstore.client() as client:
        fetched = client.get([b.block_hash for b in blocks])
        assert [got.payload for got in fetched.values() if isinstance(got, FetchedBlock)] == [
            b.payload for b in blocks
        ]
        late = raw_block("put-on-the-full-disk", BLOCK_VALUES)
        with pytest.raises(grpc.RpcError) as refused:
            client.put([late])
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "disk is full" in refused.value.details()
        filler.unlink()  # the operator makes room
        full: list[str] = []
        wait_until(
            lambda: put_when_there_is_room(client, late, full), "the put to be stored once there is room"
        )
        assert client.lookup([late.block_hash]) == [late.block_hash]


def test_disk_capacity_keeps_room_for_dead_space_and_headroom() -> None:
    segment = 64 * 1024
    assert disk_capacity_bytes(10 * segment, 0, segment, 0.5) == 4 * segment
    assert disk_capacity_bytes(0, 10 * segment, segment, 0.5) == 4 * segment  # its own segments are room
    assert disk_capacity_bytes(0, segment, segment, 0.5) == 0
