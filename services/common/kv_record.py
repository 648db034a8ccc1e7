"""The kvstore's segment record format: what a record's bytes are, and how a reader checks them.

The kvstore writes records (services/kvstore/record.py); a same-host reader (the engine, when the
kvstore hands out record locations) reads them straight from the segment files, so the format is a
contract both sides share, like the protos. Layout, little-endian:
    fixed header  `FIXED` below: magic, version, codec, flags, ndim, name lengths, store key,
                  creation time, payload length, CRC-32
    shape         ndim x u32
    tenant, model, block hash   utf-8, lengths from the fixed header
    payload       payload-length bytes

The CRC covers every header field (with the CRC field zeroed), the names, the payload, and the
record's own segment id and offset. A record read from the wrong place, a flipped byte anywhere,
or a record cut short by a crash all fail it, so a reader never serves one. A tombstone (flags
bit 0, no payload) marks a deletion.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntFlag

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


def record_crc(
    fixed: bytes, variable: bytes, payload: bytes | memoryview, segment_id: int, offset: int
) -> int:
    """The checksum of a record whose fixed header (CRC field zeroed) is `fixed`, at its place.

    zlib releases the GIL on large buffers, so readers can check payloads on several threads.
    """
    return place_crc(zlib.crc32(payload, header_crc(fixed, variable)), segment_id, offset)


def header_crc(fixed: bytes, variable: bytes) -> int:
    """The running CRC after a record's header: continue it over the payload with `zlib.crc32`
    (in pieces, as they are read), then end it with `place_crc`."""
    return zlib.crc32(variable, zlib.crc32(fixed))


def place_crc(crc: int, segment_id: int, offset: int) -> int:
    """The record's checksum: the running CRC over header and payload, ended with its place."""
    return zlib.crc32(_PLACE.pack(segment_id, offset), crc)


@dataclass(frozen=True)
class Extent:
    """How many bytes the record at a place takes, from its fixed header alone."""

    header_bytes: int
    total_bytes: int


def read_extent(fixed: bytes | bytearray | memoryview) -> Extent:
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


@dataclass(frozen=True)
class RecordHeader:
    """Everything a record says about itself before its payload."""

    codec: int
    flags: RecordFlags
    shape: tuple[int, ...]
    tenant: str
    model: str
    block_hash: str
    key: bytes  # the store key (salted); 32 bytes
    created_us: int
    payload_bytes: int
    checksum: int
    zeroed_fixed: bytes  # the fixed header with its CRC field zeroed, as the CRC covers it
    variable: bytes  # shape and names, as the CRC covers them

    @property
    def is_tombstone(self) -> bool:
        """True for a deletion marker."""
        return bool(self.flags & RecordFlags.TOMBSTONE)

    def checksum_matches(self, payload: bytes | memoryview, segment_id: int, offset: int) -> bool:
        """Whether `payload` completes this header into the intact record at this place."""
        crc = record_crc(self.zeroed_fixed, self.variable, payload, segment_id, offset)
        return crc == self.checksum

    def running_crc(self) -> int:
        """The CRC over this header, to continue over the payload (`header_crc`)."""
        return header_crc(self.zeroed_fixed, self.variable)


def parse_header(head: bytes | bytearray | memoryview) -> RecordHeader:
    """The header in `head` (exactly the record's bytes before its payload); RecordError when not one."""
    extent = read_extent(head)
    if len(head) != extent.header_bytes:
        raise RecordError(f"the record header is {extent.header_bytes} B, got {len(head)} B")
    fields = FIXED.unpack_from(head)
    _, _, codec, flags, ndim, tenant_len, model_len, hash_len, key, created_us, payload_len, checksum = fields
    variable = bytes(head[FIXED.size : extent.header_bytes])
    names = variable[4 * ndim :]
    try:
        tenant = names[:tenant_len].decode()
        model = names[tenant_len : tenant_len + model_len].decode()
        block_hash = names[tenant_len + model_len : tenant_len + model_len + hash_len].decode()
    except UnicodeDecodeError as error:
        raise RecordError(f"record names are not utf-8: {error}") from None
    return RecordHeader(
        codec=codec,
        flags=RecordFlags(flags),
        shape=struct.unpack_from(f"<{ndim}I", variable),
        tenant=tenant,
        model=model,
        block_hash=block_hash,
        key=key,
        created_us=created_us,
        payload_bytes=payload_len,
        checksum=checksum,
        zeroed_fixed=FIXED.pack(*fields[:-1], 0),
        variable=variable,
    )
