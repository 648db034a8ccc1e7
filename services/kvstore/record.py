"""One record of a segment file: a block (or a deletion) with a header and a checksum.

Layout, little-endian:
    fixed header  `FIXED` below: magic, version, codec, flags, ndim, name lengths, store key,
                  creation time, payload length, CRC-32
    shape         ndim x u32
    tenant, model, block hash   utf-8, lengths from the fixed header
    payload       payload-length bytes

The CRC covers every header field, the names, the payload, and the record's own segment id and
offset. A record read from the wrong place, a flipped byte anywhere, or a record cut short by a
crash all fail it, so a reader never serves one. A tombstone (flags bit 0, no payload) marks a
deletion, so that a rebuilt index does not bring a deleted block back.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntFlag

from services.kvstore.keys import BlockHash, StoreKey

MAGIC = b"TKVR"
VERSION = 1
MAX_DIMS = 8
FIXED = struct.Struct("<4sHHHBBBB32sQII")
_PLACE = struct.Struct("<QQ")  # segment id, offset: mixed into the CRC, never stored


class RecordFlags(IntFlag):
    """Bits of the header's flags field."""

    NONE = 0
    TOMBSTONE = 1


class RecordError(ValueError):
    """Bytes that are not a whole, intact record at the place they were read from."""


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
        checksum = _crc(header, shape + names, self.payload, segment_id, offset)
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


def _crc(fixed: bytes, variable: bytes, payload: bytes | memoryview, segment_id: int, offset: int) -> int:
    crc = zlib.crc32(fixed)
    crc = zlib.crc32(variable, crc)
    crc = zlib.crc32(payload, crc)
    return zlib.crc32(_PLACE.pack(segment_id, offset), crc)


@dataclass(frozen=True)
class Extent:
    """How many bytes the record at a place takes, from its fixed header alone."""

    header_bytes: int
    total_bytes: int


def read_extent(fixed: bytes | memoryview) -> Extent:
    """The record's size from its first FIXED.size bytes; a RecordError when they are not a header."""
    if len(fixed) < FIXED.size:
        raise RecordError(f"truncated record header ({len(fixed)} of {FIXED.size} B)")
    magic, version, _, _, ndim, tenant_len, model_len, hash_len, _, _, payload_len, _ = FIXED.unpack_from(
        fixed
    )
    if magic != MAGIC or version != VERSION or ndim > MAX_DIMS:
        raise RecordError(f"no record header here (magic {magic!r}, version {version}, ndim {ndim})")
    header_bytes = FIXED.size + 4 * ndim + tenant_len + model_len + hash_len
    return Extent(header_bytes, header_bytes + payload_len)


def decode(data: bytes | memoryview, segment_id: int, offset: int) -> Record:
    """The record in `data` (exactly its bytes), checked against its CRC and place."""
    extent = read_extent(data)
    if len(data) != extent.total_bytes:
        raise RecordError(
            f"record at {segment_id}:{offset} is {len(data)} B; its header says {extent.total_bytes} B"
        )
    fields = FIXED.unpack_from(data)
    _, _, codec, flags, ndim, tenant_len, model_len, hash_len, key, created_us, _, checksum = fields
    zeroed = FIXED.pack(*fields[:-1], 0)
    variable = bytes(data[FIXED.size : extent.header_bytes])
    payload = bytes(data[extent.header_bytes :])
    if _crc(zeroed, variable, payload, segment_id, offset) != checksum:
        raise RecordError(f"record at segment {segment_id} offset {offset} fails its checksum")
    shape = struct.unpack_from(f"<{ndim}I", variable)
    names = variable[4 * ndim :]
    tenant = names[:tenant_len].decode()
    model = names[tenant_len : tenant_len + model_len].decode()
    block_hash = BlockHash(names[tenant_len + model_len : tenant_len + model_len + hash_len].decode())
    return Record(
        StoreKey(key), tenant, model, block_hash, codec, shape, payload, created_us, RecordFlags(flags)
    )
