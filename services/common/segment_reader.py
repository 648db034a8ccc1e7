"""Same-host reads of kvstore records: the bytes straight from the segment files into the caller's
buffers, each record checked as the store checks it.

The kvstore's LocateBlocks says where a caller's blocks lie (only its own namespace's). A reader on
the same host then reads each record with `preadv`: the header into a small buffer, the payload
directly into its place in the caller's buffer (no per-block objects, no gRPC framing), and checks
it: the header is a record of this very block (tenant, model, hash, codec, shape, not a tombstone)
and the CRC over header, payload and place matches. A location gone stale (compacted, deleted), a
file this host cannot see, or a flipped byte all fail the check, and the caller asks the store for
that block instead; a payload that failed is never handed on. Reads and CRCs release the GIL, so a
pool of threads reads several records at once, and a caller may start a run's reads (`start`) and
do other work while they go.

A payload can be read and checksummed in pieces (`piece_bytes`), each piece CRC'd right after it
lands; the default reads it whole, then checks it. On the H200's host (16 vCPUs, page cache), whole
2 MB payloads read and checked at 19 GB/s on 8 threads, 4 MB pieces the same, 256 KB pieces at
9 GB/s and 64 KB at 3 (bench/results/segment_reads_h200_2026-12-03.md): each `preadv` of the page
cache costs more than the second pass over memory saves.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from services.common.kv_record import FIXED, RecordError, extend_crc, parse_header, place_crc
from services.common.kvstore_api import BlockLocation, Codec

logger = logging.getLogger(__name__)

BLOCKS_PER_TASK = 8  # records one pool task reads: fewer tasks than blocks, still spread over threads
READ_PIECE_BYTES = 0  # a payload is read and CRC'd in pieces this size; 0: whole (fastest measured)


@dataclass(frozen=True)
class ExpectedRecord:
    """What every record of one read must be: its owner, codec and shape."""

    tenant: str
    model: str
    codec: Codec
    shape: tuple[int, ...]


class SegmentFiles:
    """Open segment files of one read, by path; `close` closes them all. Safe across threads."""

    def __init__(self) -> None:
        self._descriptors: dict[str, int] = {}
        self._lock = threading.Lock()

    def descriptor(self, path: str) -> int:
        """The open file at `path` (an OSError when this host cannot open it)."""
        with self._lock:
            if path not in self._descriptors:
                self._descriptors[path] = os.open(path, os.O_RDONLY)
            return self._descriptors[path]

    def close(self) -> None:
        """Close every file opened."""
        with self._lock:
            for descriptor in self._descriptors.values():
                os.close(descriptor)
            self._descriptors.clear()


def read_record_into(
    files: SegmentFiles,
    location: BlockLocation,
    expected: ExpectedRecord,
    payload: memoryview,
    piece_bytes: int = READ_PIECE_BYTES,
) -> None:
    """Read the record at `location` with its payload landing in `payload` (exactly its size), and
    check it; RecordError (or OSError) when it is not this block's intact record."""
    head = bytearray(location.length - len(payload))
    if len(head) < FIXED.size:
        raise RecordError(f"a {location.length} B record cannot hold a {len(payload)} B payload")
    descriptor = files.descriptor(location.segment_path)
    piece = max(1, len(payload) if piece_bytes <= 0 else piece_bytes)
    _read_exactly(descriptor, [head, payload[:piece]], location.offset, location)
    header = parse_header(head)
    wanted = (expected.tenant, expected.model, location.block_hash, int(expected.codec), expected.shape)
    found = (header.tenant, header.model, header.block_hash, header.codec, header.shape)
    if header.is_tombstone or found != wanted or header.payload_bytes != len(payload):
        raise RecordError(f"the record at {location.segment_path}:{location.offset} is another block's")
    crc = extend_crc(header.version, payload[:piece], header.running_crc())
    for start in range(piece, len(payload), piece):
        part = payload[start : start + piece]
        _read_exactly(descriptor, [part], location.offset + len(head) + start, location)
        crc = extend_crc(header.version, part, crc)
    if place_crc(crc, location.segment_id, location.offset, header.version) != header.checksum:
        raise RecordError(f"the record at {location.segment_path}:{location.offset} fails its checksum")


def _read_exactly(
    descriptor: int, buffers: list[bytearray | memoryview], offset: int, location: BlockLocation
) -> None:
    wanted = sum(len(b) for b in buffers)
    num_read = os.preadv(descriptor, buffers, offset)
    if num_read != wanted:
        raise RecordError(
            f"read {num_read} of {wanted} B at {location.segment_path}:{offset} "
            f"(a record of {location.length} B at {location.offset})"
        )


class PendingRun:
    """A run of reads in flight (`SegmentReader.start`)."""

    def __init__(
        self, tasks: list[Future[tuple[int, str] | None]], num_blocks: int, first_index: int
    ) -> None:
        self._tasks = tasks
        self._num_blocks = num_blocks
        self._first_index = first_index  # the run's first block in the caller's numbering (for logs)

    def done(self) -> bool:
        """Every read of the run has ended (intact or not)."""
        return all(task.done() for task in self._tasks)

    def wait(self) -> int:
        """Block until every read has ended; how many from the first were read intact. Past that
        count the payloads may hold anything (a failed or skipped read)."""
        wait(self._tasks)  # every task is done before any error surfaces: none writes into the buffers after
        failures = [failure for failure in (t.result() for t in self._tasks) if failure is not None]
        if not failures:
            return self._num_blocks
        index, error = min(failures)
        logger.warning(
            "same-host read of block %d failed (the rest goes by the store's stream): %s",
            self._first_index + index, error,
        )  # fmt: skip
        return index


class SegmentReader:
    """Reads located records into buffers on a pool of threads; owns the pool (`close` stops it)."""

    def __init__(self, num_threads: int, piece_bytes: int = READ_PIECE_BYTES) -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="segment-read")
        self.piece_bytes = piece_bytes

    def read_run(
        self, locations: Sequence[BlockLocation], payloads: Sequence[memoryview], expected: ExpectedRecord
    ) -> int:
        """Read `locations[i]` into `payloads[i]`; returns how many from the first were read intact.
        Past that count the payloads may hold anything (a failed or skipped read)."""
        files = SegmentFiles()
        try:
            return self.start(files, locations, payloads, expected).wait()
        finally:  # every read has ended (wait): the files close after
            files.close()

    def start(
        self,
        files: SegmentFiles,
        locations: Sequence[BlockLocation],
        payloads: Sequence[memoryview],
        expected: ExpectedRecord,
        first_index: int = 0,
    ) -> PendingRun:
        """Start reading `locations[i]` into `payloads[i]` on the pool; the caller waits (and keeps
        `files` open) until the run's `wait` returns. `first_index` numbers the run's blocks in logs."""
        tasks = [
            self._pool.submit(self._read_some, files, locations, payloads, expected, start, self.piece_bytes)
            for start in range(0, len(locations), BLOCKS_PER_TASK)
        ]
        return PendingRun(tasks, len(locations), first_index)

    @staticmethod
    def _read_some(
        files: SegmentFiles,
        locations: Sequence[BlockLocation],
        payloads: Sequence[memoryview],
        expected: ExpectedRecord,
        start: int,
        piece_bytes: int,
    ) -> tuple[int, str] | None:
        """Read up to BLOCKS_PER_TASK records from `start`; the first that failed and why, or None."""
        for index in range(start, min(start + BLOCKS_PER_TASK, len(locations))):
            try:
                read_record_into(files, locations[index], expected, payloads[index], piece_bytes)
            except (RecordError, OSError, ValueError) as error:
                return index, f"{type(error).__name__}: {error}"
        return None

    def close(self) -> None:
        """Stop the threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
