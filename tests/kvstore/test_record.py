"""Segment records and block keys: what the checksum covers (in each record version, and read in
pieces), and what a key is salted with."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.common.kv_record import VERSION, extend_crc, record_crc
from services.common.kvstore_api import BlockLocation, Codec
from services.common.segment_reader import ExpectedRecord, SegmentFiles, read_record_into
from services.kvstore.keys import MAX_CACHED_SALTS, BlockHash, Namespace, TenantSalts, check_hash
from services.kvstore.record import FIXED, Record, RecordError, decode, read_extent

SECRET = bytes(range(32))


def make_record(payload: bytes = b"payload-bytes" * 10) -> Record:
    """A record of tenant-a's block."""
    namespace = Namespace("tenant-a", "tiny-llama")
    block_hash = BlockHash("ab" * 32)
    key = TenantSalts(SECRET).key(namespace, block_hash)
    return Record(key, namespace.tenant, namespace.model, block_hash, 1, (1, 2, 3), payload, 123)


def test_a_record_decodes_to_itself_at_its_own_place() -> None:
    record = make_record()
    data = record.encode(segment_id=7, offset=4096)
    assert read_extent(data[: FIXED.size]).total_bytes == len(data)
    assert decode(data, 7, 4096) == record


@pytest.mark.parametrize(("segment_id", "offset"), [(8, 4096), (7, 4097)], ids=["segment", "offset"])
def test_a_record_read_from_another_place_fails_its_checksum(segment_id: int, offset: int) -> None:
    data = make_record().encode(segment_id=7, offset=4096)
    with pytest.raises(RecordError, match="checksum"):
        decode(data, segment_id, offset)


@pytest.mark.parametrize(
    "position", [10, FIXED.size + 2, FIXED.size + 20, -1], ids=["header", "shape", "names", "payload"]
)
def test_any_flipped_byte_fails_the_record(position: int) -> None:
    data = bytearray(make_record().encode(segment_id=7, offset=4096))
    data[position] ^= 0x04
    with pytest.raises(RecordError):
        decode(bytes(data), 7, 4096)


def test_a_truncated_record_is_refused() -> None:
    data = make_record().encode(segment_id=7, offset=4096)
    with pytest.raises(RecordError, match="its header says"):
        decode(data[:-1], 7, 4096)
    with pytest.raises(RecordError, match="truncated record header"):
        read_extent(data[:10])


def test_keys_differ_by_tenant_model_and_secret() -> None:
    block_hash = BlockHash("ab" * 32)
    salts = TenantSalts(SECRET)
    keys = {
        salts.key(Namespace("tenant-a", "m"), block_hash),
        salts.key(Namespace("tenant-b", "m"), block_hash),
        salts.key(Namespace("tenant-a", "m2"), block_hash),
        TenantSalts(bytes(32)).key(Namespace("tenant-a", "m"), block_hash),
    }
    assert len(keys) == 4
    assert salts.key(Namespace("tenant-a", "m"), block_hash) == TenantSalts(SECRET).key(
        Namespace("tenant-a", "m"), block_hash
    )


def test_salt_cache_is_bounded_and_salts_survive_eviction() -> None:
    salts = TenantSalts(SECRET)
    first = salts.salt("tenant-0")
    for i in range(1, MAX_CACHED_SALTS + 100):
        salts.salt(f"tenant-{i}")
    assert salts.num_cached_salts == MAX_CACHED_SALTS
    assert salts.salt("tenant-0") == first == TenantSalts(SECRET).salt("tenant-0")


@pytest.mark.parametrize("value", ["", "ab", "AB" * 8, "xy" * 8, "a" * 129])
def test_hashes_must_be_lowercase_hex_of_sensible_length(value: str) -> None:
    with pytest.raises(InvalidArgument, match="lowercase hex"):
        check_hash(value)


def test_the_tenant_secret_is_created_once_and_kept(tmp_path) -> None:
    path = tmp_path / "data" / "tenant_secret"
    first = TenantSalts.load_or_create(path).salt("tenant-a")
    assert path.stat().st_mode & 0o777 == 0o600
    assert TenantSalts.load_or_create(path).salt("tenant-a") == first


# --- versions, and reads in pieces ----------------------------------------------------------------


def as_version_1(data: bytes, segment_id: int, offset: int) -> bytes:
    """The same record as the store wrote it before version 2: zlib's CRC-32."""
    fields = list(FIXED.unpack_from(data))
    fields[1], fields[-1] = 1, 0
    zeroed = FIXED.pack(*fields)
    extent = read_extent(data)
    variable, payload = data[FIXED.size : extent.header_bytes], data[extent.header_bytes :]
    fields[-1] = record_crc(zeroed, variable, payload, segment_id, offset, version=1)
    return FIXED.pack(*fields) + data[FIXED.size :]


def test_each_version_checks_with_its_own_crc() -> None:
    # the standard check values of CRC-32 (zlib) and CRC-32C (Castagnoli) over "123456789"
    assert extend_crc(1, b"123456789", 0) == 0xCBF43926
    assert extend_crc(2, b"123456789", 0) == 0xE3069283
    data = make_record().encode(segment_id=7, offset=4096)
    assert FIXED.unpack_from(data)[1] == VERSION == 2
    old = as_version_1(data, 7, 4096)
    assert old != data and decode(old, 7, 4096) == make_record()  # segments written before still read
    unknown = bytearray(data)
    unknown[4:6] = (3).to_bytes(2, "little")
    with pytest.raises(RecordError, match="version 3"):
        decode(bytes(unknown), 7, 4096)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("piece_bytes", [0, 16, 1000])
def test_a_same_host_read_in_pieces_checks_the_whole_record(
    tmp_path: Path, version: int, piece_bytes: int
) -> None:
    """A payload read and CRC'd in pieces: intact, it reads back; a byte flipped in any piece (the
    first, a middle one, the last) fails the check, in either version."""
    record = make_record(bytes(range(256)) * 2)
    data = record.encode(segment_id=3, offset=64)
    if version == 1:
        data = as_version_1(data, 3, 64)
    location = BlockLocation(
        record.block_hash, Codec(record.codec), str(tmp_path / "s.seg"), 3, 64, len(data)
    )
    expected = ExpectedRecord(record.tenant, record.model, Codec(record.codec), record.shape)
    header_bytes = len(data) - len(record.payload)
    for flipped in (None, header_bytes, header_bytes + 300, len(data) - 1):
        on_disk = bytearray(64) + bytearray(data)
        if flipped is not None:
            on_disk[64 + flipped] ^= 0x10
        Path(location.segment_path).write_bytes(bytes(on_disk))
        payload = bytearray(len(record.payload))
        files = SegmentFiles()
        try:
            if flipped is None:
                read_record_into(files, location, expected, memoryview(payload), piece_bytes)
                assert bytes(payload) == record.payload
            else:
                with pytest.raises(RecordError, match="checksum"):
                    read_record_into(files, location, expected, memoryview(payload), piece_bytes)
        finally:
            files.close()
