"""How many live bytes the store may keep: the configured capacity, or less where the disk holds less.

Eviction bounds live bytes, but the disk holds dead ones too: compaction rewrites a sealed segment
only once its live share is under `compact_live_ratio`, so sealed segments can take up to
live / ratio bytes (2x at the default 0.5), and the active segment and a compaction's copies need
room on top. A capacity above what that allows fills the disk before eviction ever runs, and then
every put fails for good. So the capacity in force is the smaller of the configured one and

    (free bytes + the store's segment bytes - HEADROOM_SEGMENTS segments) * compact_live_ratio

recomputed at start and at each maintenance pass (the disk may be shared, and fill up from
elsewhere). The store's own segment bytes count as room, since eviction and compaction can free
them.
"""

from __future__ import annotations

import os
from pathlib import Path

HEADROOM_SEGMENTS = 2  # the active segment, and the segment a compaction copies into


def free_disk_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still take on the filesystem of `directory` (blocking)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def disk_capacity_bytes(
    free_bytes: int, segment_bytes: int, max_segment_bytes: int, compact_live_ratio: float
) -> int:
    """The live bytes the disk can hold, dead space and headroom included (module docstring)."""
    room = free_bytes + segment_bytes - HEADROOM_SEGMENTS * max_segment_bytes
    return max(0, int(room * compact_live_ratio))
