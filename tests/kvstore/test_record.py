"""Segment records and block keys: what the checksum covers, and what a key is salted with."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.kvstore.keys import BlockHash, Namespace, TenantSalts, check_hash
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


@pytest.mark.parametrize("value", ["", "ab", "AB" * 8, "xy" * 8, "a" * 129])
def test_hashes_must_be_lowercase_hex_of_sensible_length(value: str) -> None:
    with pytest.raises(InvalidArgument, match="lowercase hex"):
        check_hash(value)


def test_the_tenant_secret_is_created_once_and_kept(tmp_path) -> None:
    path = tmp_path / "data" / "tenant_secret"
    first = TenantSalts.load_or_create(path).salt("tenant-a")
    assert path.stat().st_mode & 0o777 == 0o600
    assert TenantSalts.load_or_create(path).salt("tenant-a") == first
