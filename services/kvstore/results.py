"""What the store's calls return: put and prefetch results, a write awaiting its fsync, and stats."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.kvstore_api import PrefetchResult, PutResult
from services.kvstore.index import IndexEntry
from services.kvstore.keys import BlockHash, StoreKey
from services.kvstore.segments import Location

__all__ = ["BlockLocated", "PendingWrite", "PrefetchResult", "PutResult", "StoreCounters", "StoreStats"]


@dataclass
class StoreCounters:
    """Events since start, for GetStats."""

    evicted_blocks: int = 0
    expired_blocks: int = 0
    corrupt_records: int = 0
    compacted_segments: int = 0
    staging_hits: int = 0
    disk_reads: int = 0
    index_rebuilds: int = 0
    located_blocks: int = 0  # locations handed out by LocateBlocks (the caller read the bytes)


@dataclass(frozen=True)
class StoreStats:
    """Occupancy and counters."""

    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    staged_blocks: int
    staged_bytes: int
    disk_bytes: int
    num_segments: int
    counters: StoreCounters


@dataclass(frozen=True)
class PendingWrite:
    """A record written to its segment, waiting for its fsync and its index entry."""

    block_hash: BlockHash
    key: StoreKey
    entry: IndexEntry
    seq: int


@dataclass(frozen=True)
class BlockLocated:
    """Where a present block's record lies, for a caller that reads the segment file itself."""

    block_hash: BlockHash
    codec: int
    segment_path: Path
    location: Location
