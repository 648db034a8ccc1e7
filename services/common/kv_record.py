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

Versions: a version 2 record (written since 2026-12-03) is checked with CRC-32C (Castagnoli), which
x86-64 (SSE4.2) and ARMv8 compute in hardware: the `crc32c` package does 13 GB/s a core where
zlib's CRC-32 does 4, and the check is a third of the CPU time of a same-host prefix read
(bench/results/segment_reads_*.md). Version 1 records (zlib's CRC-32) still read: segments
written before stay valid, and compaction rewrites them as version 2.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntFlag

import crc32c

MAGIC = b"TKVR"
VERSION = 2  # what the store writes
# How each readable version's checksum goes on over more bytes: `extend(data, crc)`.
_EXTEND: dict[int, Callable[[bytes | bytearray | memoryview, int], int]] = {
    1: zlib.crc32,
    2: crc32c.crc32c,
}
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
    fixed: bytes,
    variable: bytes,
    payload: bytes | memoryview,
    segment_id: int,
    offset: int,
    version: int = VERSION,
) -> int:
    """The checksum of a record whose fixed header (CRC field zeroed) is `fixed`, at its place.

    Both checksums release the GIL on large buffers, so readers check payloads on several threads.
    """
    crc = extend_crc(version, payload, header_crc(fixed, variable, version))
    return place_crc(crc, segment_id, offset, version)


def header_crc(fixed: bytes, variable: bytes, version: int = VERSION) -> int:
    """The running CRC after a record's header: continue it over the payload with `extend_crc`
    (in pieces, as they are read), then end it with `place_crc`."""
    return extend_crc(version, variable, extend_crc(version, fixed, 0))


def extend_crc(version: int, data: bytes | bytearray | memoryview, crc: int) -> int:
    """A version's running CRC, continued over `data`."""
    return _EXTEND[version](data, crc)


def place_crc(crc: int, segment_id: int, offset: int, version: int = VERSION) -> int:
    """The record's checksum: the running CRC over header and payload, ended with its place."""
    return extend_crc(version, _PLACE.pack(segment_id, offset), crc)


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
    if magic != MAGIC or version not in _EXTEND or ndim > MAX_DIMS:
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
    version: int = VERSION  # which checksum the record was written with

    @property
    def is_tombstone(self) -> bool:
        """True for a deletion marker."""
        return bool(self.flags & RecordFlags.TOMBSTONE)

    def checksum_matches(self, payload: bytes | memoryview, segment_id: int, offset: int) -> bool:
        """Whether `payload` completes this header into the intact record at this place."""
        crc = record_crc(self.zeroed_fixed, self.variable, payload, segment_id, offset, self.version)
        return crc == self.checksum

    def running_crc(self) -> int:
        """The CRC over this header, to continue over the payload with `extend_crc(version, ...)`
        and end with `place_crc(..., version)`."""
        return header_crc(self.zeroed_fixed, self.variable, self.version)


def parse_header(head: bytes | bytearray | memoryview) -> RecordHeader:
    """The header in `head` (exactly the record's bytes before its payload); RecordError when not one."""
    extent = read_extent(head)
    if len(head) != extent.header_bytes:
        raise RecordError(f"the record header is {extent.header_bytes} B, got {len(head)} B")
    fields = FIXED.unpack_from(head)
    _, version, codec, flags, ndim, tenant_len, model_len, hash_len, key, created_us, payload_len, crc = (
        fields
    )
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
        checksum=crc,
        zeroed_fixed=FIXED.pack(*fields[:-1], 0),
        variable=variable,
        version=version,
    )
