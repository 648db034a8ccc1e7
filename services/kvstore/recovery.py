"""Rebuilding the index from the segments alone: what a scan of every record says is live."""

from __future__ import annotations

from pathlib import Path

from services.kvstore.index import IndexEntry
from services.kvstore.keys import StoreKey
from services.kvstore.segments import list_segments, scan_segment


def scan_live_entries(
    segments_dir: Path, ttl_s: float, now_us: int
) -> tuple[dict[StoreKey, IndexEntry], int]:
    """The live entry of every key, and how many bad stretches the scan skipped (blocking).

    Segments are read oldest first and records in file order, so the newest record of a key wins;
    a tombstone deletes the key; a record created more than `ttl_s` ago (0: no TTL) is left out.
    """
    entries: dict[StoreKey, IndexEntry] = {}
    expired_before = now_us - int(ttl_s * 1_000_000) if ttl_s else 0
    num_corrupt = 0
    for segment_id in list_segments(segments_dir):
        scan = scan_segment(segments_dir, segment_id)
        num_corrupt += scan.num_corrupt
        for found in scan.records:
            record = found.record
            if record.is_tombstone or record.created_us < expired_before:
                entries.pop(record.key, None)
                continue
            entries[record.key] = IndexEntry(found.location, record.codec, record.tenant, record.created_us)
    return entries, num_corrupt
