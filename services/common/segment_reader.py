"""Same-host reads of kvstore records: the bytes straight from the segment files into the caller's
buffers, each record checked as the store checks it.

The kvstore's LocateBlocks says where a caller's blocks lie (only its own namespace's). A reader on
the same host then reads each record with one `preadv`: the header into a small buffer, the payload
directly into its place in the caller's buffer (no per-block objects, no gRPC framing), and checks
it: the header is a record of this very block (tenant, model, hash, codec, shape, not a tombstone)
and the CRC over header, payload and place matches. A location gone stale (compacted, deleted), a
file this host cannot see, or a flipped byte all fail the check, and the caller asks the store for
that block instead; a payload that failed is never handed on. Reads and CRCs release the GIL, so a
pool of threads reads several records at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from services.common.kv_record import FIXED, RecordError, parse_header
from services.common.kvstore_api import BlockLocation, Codec

logger = logging.getLogger(__name__)

BLOCKS_PER_TASK = 8  # records one pool task reads: fewer tasks than blocks, still spread over threads


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
    files: SegmentFiles, location: BlockLocation, expected: ExpectedRecord, payload: memoryview
) -> None:
    """Read the record at `location` with its payload landing in `payload` (exactly its size), and
    check it; RecordError (or OSError) when it is not this block's intact record."""
    head = bytearray(location.length - len(payload))
    if len(head) < FIXED.size:
        raise RecordError(f"a {location.length} B record cannot hold a {len(payload)} B payload")
    num_read = os.preadv(files.descriptor(location.segment_path), [head, payload], location.offset)
    if num_read != location.length:
        raise RecordError(
            f"read {num_read} of {location.length} B at {location.segment_path}:{location.offset}"
        )
    header = parse_header(head)
    wanted = (expected.tenant, expected.model, location.block_hash, int(expected.codec), expected.shape)
    found = (header.tenant, header.model, header.block_hash, header.codec, header.shape)
    if header.is_tombstone or found != wanted or header.payload_bytes != len(payload):
        raise RecordError(f"the record at {location.segment_path}:{location.offset} is another block's")
    if not header.checksum_matches(payload, location.segment_id, location.offset):
        raise RecordError(f"the record at {location.segment_path}:{location.offset} fails its checksum")


class SegmentReader:
    """Reads located records into buffers on a pool of threads; owns the pool (`close` stops it)."""

    def __init__(self, num_threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="segment-read")

    def read_run(
        self, locations: Sequence[BlockLocation], payloads: Sequence[memoryview], expected: ExpectedRecord
    ) -> int:
        """Read `locations[i]` into `payloads[i]`; returns how many from the first were read intact.
        Past that count the payloads may hold anything (a failed or skipped read)."""
        files = SegmentFiles()
        try:
            starts = range(0, len(locations), BLOCKS_PER_TASK)
            tasks = [
                self._pool.submit(self._read_some, files, locations, payloads, expected, start)
                for start in starts
            ]
            wait(tasks)  # every task is done before any error surfaces: none writes into the buffers after
            failures = [failure for failure in (t.result() for t in tasks) if failure is not None]
            if not failures:  # all done: files close after
                return len(locations)
            index, error = min(failures)
            logger.warning(
                "same-host read of block %d of %d failed (the rest goes by the store's stream): %s",
                index, len(locations), error,
            )  # fmt: skip
            return index
        finally:
            files.close()

    @staticmethod
    def _read_some(
        files: SegmentFiles,
        locations: Sequence[BlockLocation],
        payloads: Sequence[memoryview],
        expected: ExpectedRecord,
        start: int,
    ) -> tuple[int, str] | None:
        """Read up to BLOCKS_PER_TASK records from `start`; the first that failed and why, or None."""
        for index in range(start, min(start + BLOCKS_PER_TASK, len(locations))):
            try:
                read_record_into(files, locations[index], expected, payloads[index])
            except (RecordError, OSError, ValueError) as error:
                return index, f"{type(error).__name__}: {error}"
        return None

    def close(self) -> None:
        """Stop the threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
