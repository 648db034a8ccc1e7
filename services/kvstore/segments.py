"""Append-only segment files: the writer (aiofiles, rotation, group-committed fsync), reads, scans.

A segment is `<data dir>/segments/<id, 12 digits>.seg`: a 16-byte header (magic, segment id), then
records back to back. Only the active segment grows; a restarted store opens a new one, so a
record torn by a crash stays at the end of a sealed segment, where scans skip it.

Durability is a sequence number: `append` returns the record's, and `wait_durable` returns once an
fsync has covered it. Under `batch` (the default) the first waiter opens a window of
`batch_window_s` for other writers before one fsync covers them all; under `always` it fsyncs at
once (writers that arrive during an fsync still share the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import aiofiles
from aiofiles.threadpool.binary import AsyncFileIO

from services.kvstore import record as records
from services.kvstore.record import Record, RecordError

log = logging.getLogger(__name__)

SEGMENT_MAGIC = b"TKVSEG01"
# Segments hold every tenant's KV and names: readable by the store's own user only (the engine's
# same-host reads run as that user too, as the image's services all do).
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
SEGMENT_HEADER = struct.Struct("<8sQ")
SUFFIX = ".seg"


class FsyncPolicy(StrEnum):
    """When a write counts as durable."""

    ALWAYS = "always"
    BATCH = "batch"


@dataclass(frozen=True)
class Location:
    """Where a record sits."""

    segment_id: int
    offset: int
    length: int


def segment_path(directory: Path, segment_id: int) -> Path:
    """The file of one segment."""
    return directory / f"{segment_id:012d}{SUFFIX}"


def list_segments(directory: Path) -> list[int]:
    """Ids of the segments on disk, oldest first."""
    return sorted(int(p.stem) for p in directory.glob(f"*{SUFFIX}") if p.stem.isdigit())


def segments_tail(directory: Path) -> str:
    """Where the segments end: the newest segment's id and size ("" when there is none). Each
    store start begins a new segment, so a tail never comes back once records follow it."""
    existing = list_segments(directory) if directory.exists() else []
    if not existing:
        return ""
    return f"{existing[-1]}:{segment_path(directory, existing[-1]).stat().st_size}"


def segment_bytes(directory: Path) -> int:
    """Bytes of every segment file together (a segment compacted away meanwhile counts nothing)."""
    total = 0
    for path in directory.glob(f"*{SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


class SegmentWriter:
    """Appends records to the active segment, rotates it, and fsyncs for durability.

    State changes: `append` (the file grows, maybe a new segment), `wait_durable` (an fsync).

    `_size` is always where the file ends: a write that fails is cut back off (or, when even that
    fails, the segment is sealed), so the next record's offset, which its CRC covers, is where it
    lands. A failed fsync loses every record it covered and seals the segment: Linux can report a
    later fsync of that file as a success after dropping the dirty pages, so none is trusted again.
    """

    def __init__(
        self, directory: Path, max_segment_bytes: int, policy: FsyncPolicy, batch_window_s: float
    ) -> None:
        self.directory = directory
        self.max_segment_bytes = max_segment_bytes
        self.policy = policy
        self.batch_window_s = batch_window_s if policy is FsyncPolicy.BATCH else 0.0
        self.segment_id = 0
        self._file: AsyncFileIO | None = None  # None: sealed, and the next one not started yet
        self._size = 0
        self._written_seq = 0
        self._durable_seq = 0  # every record up to here is settled: durable, or in `_lost_seqs`
        self._lost_seqs: list[range] = []  # records of sealed segments that no fsync covered
        self._lost_from: int | None = None  # the active segment's fsync failed: records from here are lost
        self._is_sealing = False  # the active segment takes no more records (torn bytes stayed)
        self._append_lock = asyncio.Lock()
        self._sync_lock = asyncio.Lock()
        self._flush: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Starts a new active segment after the newest on disk. On a full disk it starts none: the
        store serves reads, and the next append starts the segment (or fails) instead."""
        make_private(self.directory)
        existing = list_segments(self.directory)
        newest = existing[-1] if existing else 0
        try:
            await self._start_segment(newest + 1)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            log.error("the disk is full: no new segment until there is room (%s)", error)
            self.segment_id = newest  # the next append starts newest + 1

    async def _start_segment(self, segment_id: int) -> None:
        path = segment_path(self.directory, segment_id)
        file = await aiofiles.open(path, "xb", buffering=0, opener=_private_file)
        try:
            await _write_all(file, SEGMENT_HEADER.pack(SEGMENT_MAGIC, segment_id))
            await asyncio.to_thread(_fsync_file_and_directory, file.fileno(), self.directory)
        except BaseException:  # no half-made segment: the next append starts this id again
            await file.close()
            path.unlink(missing_ok=True)
            raise
        self._file, self.segment_id, self._size = file, segment_id, SEGMENT_HEADER.size
        self._is_sealing = False

    async def append(self, record: Record) -> tuple[Location, int]:
        """Writes a record (not yet durable); returns where it went and its sequence number.

        OSError when the write failed: nothing of the record stays in the segment. A cancelled
        caller does not cut the write short: it runs to its end in its own task."""
        return await asyncio.shield(self._append(record))

    async def _append(self, record: Record) -> tuple[Location, int]:
        async with self._append_lock:
            if self._must_rotate():
                await self._rotate()
            assert self._file is not None
            offset = self._size
            data = record.encode(self.segment_id, offset)
            try:
                await _write_all(self._file, data)
            except OSError:
                await self._cut_torn_bytes()
                raise
            self._size += len(data)
            self._written_seq += 1
            return Location(self.segment_id, offset, len(data)), self._written_seq

    def _must_rotate(self) -> bool:
        return (
            self._file is None
            or self._is_sealing
            or self._lost_from is not None
            or self._size >= self.max_segment_bytes
        )

    async def _cut_torn_bytes(self) -> None:
        """After a failed write: the file back to its last whole record, or sealed if that fails too."""
        assert self._file is not None
        try:
            await asyncio.to_thread(_truncate, self._file.fileno(), self._size)
        except OSError as error:
            log.error("segment %d: cannot cut a failed write off (%s); sealing it", self.segment_id, error)
            self._is_sealing = True

    async def _rotate(self) -> None:
        """Seals the active segment (fsynced, closed) and starts the next; under the append lock."""
        if self._file is not None:
            async with self._sync_lock:
                await self._seal()
        await self._start_segment(self.segment_id + 1)

    async def _seal(self) -> None:
        """Fsyncs (unless an fsync failed already) and closes the active segment; under both locks.
        Every record written to it is settled afterwards: durable, or lost."""
        assert self._file is not None
        with contextlib.suppress(OSError):  # a failure is recorded in `_lost_from`
            await self._fsync()
        try:
            await self._file.close()
        except OSError as error:
            log.error("segment %d: closing it failed: %s", self.segment_id, error)
        self._file = None
        if self._lost_from is not None:
            self._lost_seqs.append(range(self._lost_from, self._written_seq + 1))
            self._lost_from = None
        self._durable_seq = self._written_seq

    async def _fsync(self) -> None:
        """Fsyncs the active segment; under the sync lock. A failure loses every record not yet durable."""
        if self._file is None or self._lost_from is not None:
            return  # sealed: nothing more can become durable in it
        target = self._written_seq
        try:
            await asyncio.to_thread(os.fsync, self._file.fileno())
        except OSError as error:
            log.error("segment %d: fsync failed (%s); its unsynced records are lost", self.segment_id, error)
            self._lost_from = self._durable_seq + 1
            raise
        self._durable_seq = max(self._durable_seq, target)

    def is_lost(self, seq: int) -> bool:
        """Whether the write with sequence number `seq` can never become durable (an fsync failed)."""
        if self._lost_from is not None and seq >= self._lost_from:
            return True
        return any(seq in lost for lost in self._lost_seqs)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No appends while inside (an index rebuild scans the active segment too)."""
        async with self._append_lock:
            yield

    async def wait_durable(self, seq: int) -> None:
        """Returns once an fsync has covered the write with sequence number `seq`; OSError when the
        fsync that covered it failed (the write is lost, and must not be acknowledged)."""
        while not self.is_lost(seq):
            if self._durable_seq >= seq:
                return
            if self._flush is None:
                self._flush = asyncio.create_task(self._fsync_after_window())
            with contextlib.suppress(OSError):  # whose write it lost is read from `is_lost`
                await asyncio.shield(self._flush)
        raise OSError(errno.EIO, "the fsync that covered this write failed, so the write is lost")

    async def _fsync_after_window(self) -> None:
        try:
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)  # let other writers join this fsync
            async with self._sync_lock:
                await self._fsync()
        finally:
            self._flush = None

    async def close(self) -> None:
        """Fsyncs and closes the active segment."""
        async with self._append_lock, self._sync_lock:
            if self._file is not None:
                await self._seal()


def make_private(directory: Path) -> None:
    """Creates `directory` (mode 0700) if need be, and takes away what other users may do with it
    and with the segments in it (written by an older store, with the umask's modes)."""
    directory.mkdir(parents=True, exist_ok=True, mode=DIRECTORY_MODE)
    for path, mode in [(directory, DIRECTORY_MODE)] + [(p, FILE_MODE) for p in directory.glob(f"*{SUFFIX}")]:
        if path.stat().st_mode & 0o077:
            try:
                path.chmod(mode)
            except OSError as error:  # not ours to change (a mount point): say so, and go on
                log.warning("cannot make %s private to the kvstore's user: %s", path, error)


def _private_file(path: str, flags: int) -> int:
    return os.open(path, flags, FILE_MODE)


async def _write_all(file: AsyncFileIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = await file.write(view)
        view = view[written:]


def _truncate(descriptor: int, size: int) -> None:
    """Cuts a file back to `size` bytes and puts its position there."""
    os.ftruncate(descriptor, size)
    os.lseek(descriptor, size, os.SEEK_SET)


def _fsync_file_and_directory(descriptor: int, directory: Path) -> None:
    """A new segment's header and its directory entry both survive a crash."""
    os.fsync(descriptor)
    directory_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_descriptor)
    finally:
        os.close(directory_descriptor)


def _pread(path: Path, location: Location) -> bytes:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        return os.pread(descriptor, location.length, location.offset)
    finally:
        os.close(descriptor)


def _read_and_decode(directory: Path, location: Location) -> Record:
    data = _pread(segment_path(directory, location.segment_id), location)
    return records.decode(data, location.segment_id, location.offset)


async def read_record(directory: Path, location: Location) -> Record:
    """The record at `location`, checked; RecordError when corrupt or short, FileNotFoundError when
    its segment has been compacted away (the caller looks the key up again). The read and the CRC
    run on a worker thread (the CRC releases the GIL), off the event loop that sends replies."""
    return await asyncio.to_thread(_read_and_decode, directory, location)


@dataclass(frozen=True)
class ScannedRecord:
    """A record found by a scan, with its place."""

    location: Location
    record: Record


@dataclass(frozen=True)
class SegmentScan:
    """Every intact record of one segment, and how many stretches of bytes were not records."""

    segment_id: int
    records: list[ScannedRecord]
    num_corrupt: int
    file_bytes: int


def scan_segment(directory: Path, segment_id: int) -> SegmentScan:
    """Reads a whole segment (blocking). After a bad record it resumes at the next record magic."""
    data = segment_path(directory, segment_id).read_bytes()
    found: list[ScannedRecord] = []
    num_corrupt = 0
    position = SEGMENT_HEADER.size
    if data[:8] != SEGMENT_MAGIC:
        log.error("segment %d has no segment header; scanning it for records anyway", segment_id)
        first_magic = data.find(records.MAGIC)
        num_corrupt, position = 1, first_magic if first_magic >= 0 else len(data)
    while position < len(data):
        try:
            extent = records.read_extent(data[position : position + records.FIXED.size])
            end = position + extent.total_bytes
            item = records.decode(data[position:end], segment_id, position)
        except RecordError as error:
            num_corrupt += 1
            log.warning("segment %d: skipping bad bytes at %d: %s", segment_id, position, error)
            next_magic = data.find(records.MAGIC, position + 1)
            position = next_magic if next_magic >= 0 else len(data)
            continue
        found.append(ScannedRecord(Location(segment_id, position, end - position), item))
        position = end
    return SegmentScan(segment_id, found, num_corrupt, len(data))
