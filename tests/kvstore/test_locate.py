"""LocateBlocks and same-host reads, against a real kvstore process, real Redis and real segment files.

A caller on the store's host reads its blocks' records itself (services/common/segment_reader.py):
the bytes it reads equal what GetBlocks serves, a flipped byte or a stale place is refused, the
store hands out locations only when told to, and only for the caller's own namespace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.kv_record import RecordError
from services.common.kvstore_api import BlockLocation, FetchedBlock, MissReason
from services.common.segment_reader import ExpectedRecord, SegmentFiles, SegmentReader, read_record_into
from services.kvstore.blocks import BlockIn, Codec
from services.kvstore.config import KVStoreConfig
from tests.kvstore.conftest import SMALL_SEGMENTS, KVStoreProcess, RedisServer, block_hash, raw_block

NAMES = [f"located-{n}" for n in range(6)]
SERVING = SMALL_SEGMENTS | {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"}  # several blocks per segment


@pytest.fixture
def locating(tmp_path: Path, redis_server: RedisServer) -> Iterator[KVStoreProcess]:
    """A kvstore that hands out record locations."""
    process = KVStoreProcess(tmp_path / "kvstore", redis_server.url, SERVING).start()
    yield process
    process.stop()


def expected_of(block: BlockIn, tenant: str = "tenant-a") -> ExpectedRecord:
    return ExpectedRecord(tenant, "tiny-llama", Codec.RAW, block.shape)


def read(location: BlockLocation, block: BlockIn, tenant: str = "tenant-a") -> bytes:
    """The payload read from the segment file at `location`, checked as a record of `block`."""
    payload = bytearray(len(block.payload))
    files = SegmentFiles()
    try:
        read_record_into(files, location, expected_of(block, tenant), memoryview(payload))
    finally:
        files.close()
    return bytes(payload)


def test_located_records_read_back_as_the_stored_payloads(locating: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    with locating.client() as client:
        client.put(blocks)
        asked = [blocks[3].block_hash, block_hash("absent"), *(b.block_hash for b in blocks)]
        locations = client.locate(asked)
        assert client.stats().located_blocks == len(asked) - 1  # every present one, block 3 twice
    assert [loc.block_hash for loc in locations] == [blocks[3].block_hash, *(b.block_hash for b in blocks)]
    assert len({loc.segment_path for loc in locations}) > 1  # small segments: the blocks span several
    by_hash = {b.block_hash: b for b in blocks}
    for location in locations:
        assert Path(location.segment_path).is_absolute() and location.codec is Codec.RAW
        assert read(location, by_hash[location.block_hash]) == by_hash[location.block_hash].payload


def test_the_pool_reads_a_run_until_the_first_record_that_fails(locating: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    with locating.client() as client:
        client.put(blocks)
        locations = client.locate([b.block_hash for b in blocks])
    payloads = [memoryview(bytearray(len(b.payload))) for b in blocks]
    reader = SegmentReader(num_threads=3)
    expected = expected_of(blocks[0])
    assert reader.read_run(locations, payloads, expected) == len(blocks)
    assert [bytes(p) for p in payloads] == [b.payload for b in blocks]
    # block 4's location points at block 5's record (as after a mix-up): the run ends at block 4
    stale = [
        *locations[:4],
        dataclasses.replace(locations[5], block_hash=locations[4].block_hash),
        locations[5],
    ]
    assert reader.read_run(stale, payloads, expected) == 4
    reader.close()


def test_a_flipped_byte_is_refused_by_the_reader_and_the_store(locating: KVStoreProcess) -> None:
    block = raw_block("flipped")
    with locating.client() as client:
        client.put([block])
        (location,) = client.locate([block.block_hash])
        segment = Path(location.segment_path)
        data = bytearray(segment.read_bytes())
        data[location.offset + location.length - 100] ^= 0x01  # in the payload
        segment.write_bytes(bytes(data))
        with pytest.raises(RecordError, match="checksum"):
            read(location, block)
        assert client.get([block.block_hash]) == {block.block_hash: MissReason.CORRUPT}
        assert client.locate([block.block_hash]) == []  # the store dropped the entry


def test_a_record_is_refused_when_read_for_another_owner_or_shape(locating: KVStoreProcess) -> None:
    block = raw_block("owned")
    with locating.client() as client:
        client.put([block])
        (location,) = client.locate([block.block_hash])
    with pytest.raises(RecordError, match="another block's"):
        read(location, block, tenant="tenant-b")
    wider = BlockIn(block.block_hash, block.codec, (1, 2, 750, 2, 1), block.payload)
    with pytest.raises(RecordError, match="another block's"):
        read(location, wider)
    with pytest.raises(RecordError):
        read(dataclasses.replace(location, offset=location.offset + 1), block)


def test_one_tenant_never_locates_another_tenants_blocks(locating: KVStoreProcess) -> None:
    blocks = [raw_block(name) for name in NAMES]
    hashes = [b.block_hash for b in blocks]
    with locating.client("tenant-a") as alice, locating.client("tenant-b") as bob:
        alice.put(blocks)
        assert bob.locate(hashes) == []
        with locating.client("tenant-a", model="another-model") as other_model:
            assert other_model.locate(hashes) == []
        # the same hash with other bytes is bob's own block: his location is his record, not alice's
        impostor = raw_block("not alice's")
        forged = BlockIn(hashes[0], impostor.codec, impostor.shape, impostor.payload)
        bob.put([forged])
        (his,) = bob.locate(hashes)
        alices = alice.locate(hashes)
    assert [loc.block_hash for loc in alices] == hashes
    assert (his.segment_path, his.offset) != (alices[0].segment_path, alices[0].offset)
    assert read(his, forged, tenant="tenant-b") == forged.payload
    assert read(alices[0], blocks[0]) == blocks[0].payload


def test_a_store_hands_out_no_locations_unless_told_to(shared_kvstore: KVStoreProcess) -> None:
    block = raw_block("not located")
    with shared_kvstore.client("tenant-no-locations") as client:
        client.put([block])
        with pytest.raises(grpc.RpcError) as raised:
            client.locate([block.block_hash])
        fetched = client.get([block.block_hash])[block.block_hash]
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "THERMOCLINE_KVSTORE_SERVE_LOCATIONS" in raised.value.details()  # type: ignore[attr-defined]
    assert isinstance(fetched, FetchedBlock)


def test_serving_locations_is_a_setting_and_off_by_default() -> None:
    assert not KVStoreConfig.from_env({}).store.serve_locations
    setting = {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"}
    assert KVStoreConfig.from_env(setting).store.serve_locations
