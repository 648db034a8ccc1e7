"""One record of a segment file: a block (or a deletion) with a header and a checksum.

The format (layout, checksum, flags) is services/common/kv_record.py, shared with same-host readers;
this module builds records and decodes them whole. The CRC covers every header field, the names,
the payload, and the record's own segment id and offset. A record read from the wrong place, a
flipped byte anywhere, or a record cut short by a crash all fail it, so a reader never serves one.
A tombstone (flags bit 0, no payload) marks a deletion, so that a rebuilt index does not bring a
deleted block back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from services.common.kv_record import (
    FIXED,
    MAGIC,
    MAX_DIMS,
    VERSION,
    Extent,
    RecordError,
    RecordFlags,
    parse_header,
    read_extent,
    record_crc,
)
from services.kvstore.keys import BlockHash, StoreKey

__all__ = [
    "FIXED",
    "MAGIC",
    "MAX_DIMS",
    "VERSION",
    "Extent",
    "Record",
    "RecordError",
    "RecordFlags",
    "decode",
    "read_extent",
]


@dataclass(frozen=True)
class Record:
    """A block as stored: who it belongs to, what it is, and its payload."""

    key: StoreKey
    tenant: str
    model: str
    block_hash: BlockHash
    codec: int
    shape: tuple[int, ...]
    payload: bytes
    created_us: int
    flags: RecordFlags = RecordFlags.NONE

    @property
    def is_tombstone(self) -> bool:
        """True for a deletion marker."""
        return bool(self.flags & RecordFlags.TOMBSTONE)

    def encode(self, segment_id: int, offset: int) -> bytes:
        """The record's bytes for this place in this segment."""
        names = self.tenant.encode() + self.model.encode() + self.block_hash.encode()
        shape = struct.pack(f"<{len(self.shape)}I", *self.shape)
        header = self._fixed(checksum=0)
        checksum = record_crc(header, shape + names, self.payload, segment_id, offset)
        return self._fixed(checksum) + shape + names + self.payload

    def _fixed(self, checksum: int) -> bytes:
        return FIXED.pack(
            MAGIC,
            VERSION,
            self.codec,
            self.flags,
            len(self.shape),
            len(self.tenant.encode()),
            len(self.model.encode()),
            len(self.block_hash),
            self.key,
            self.created_us,
            len(self.payload),
            checksum,
        )

    def tombstone(self, created_us: int) -> Record:
        """A deletion marker for this record's key."""
        return Record(
            self.key,
            self.tenant,
            self.model,
            self.block_hash,
            self.codec,
            (),
            b"",
            created_us,
            RecordFlags.TOMBSTONE,
        )


def decode(data: bytes | memoryview, segment_id: int, offset: int) -> Record:
    """The record in `data` (exactly its bytes), checked against its CRC and place."""
    extent = read_extent(data)
    if len(data) != extent.total_bytes:
        raise RecordError(
            f"record at {segment_id}:{offset} is {len(data)} B; its header says {extent.total_bytes} B"
        )
    header = parse_header(data[: extent.header_bytes])
    payload = bytes(data[extent.header_bytes :])
    if not header.checksum_matches(payload, segment_id, offset):
        raise RecordError(f"record at segment {segment_id} offset {offset} fails its checksum")
    return Record(
        StoreKey(header.key),
        header.tenant,
        header.model,
        BlockHash(header.block_hash),
        header.codec,
        header.shape,
        payload,
        header.created_us,
        header.flags,
    )
