"""Segment files hold every tenant's KV and names: only the kvstore's own user may read them,
including segments an older store left with the umask's modes."""

from __future__ import annotations

import stat
from pathlib import Path

from services.kvstore.segments import list_segments, segment_path
from tests.kvstore.conftest import KVStoreProcess, raw_block


def modes(kvstore: KVStoreProcess) -> dict[str, int]:
    """The permission bits of the segments dir and of every segment, by name."""
    directory = kvstore.data_dir / "segments"
    paths: list[Path] = [directory] + [segment_path(directory, s) for s in list_segments(directory)]
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in paths}


def test_segments_are_readable_by_the_kvstores_user_only(kvstore: KVStoreProcess) -> None:
    with kvstore.client() as client:
        client.put([raw_block(f"block-{n}") for n in range(4)])  # several segments
    found = modes(kvstore)
    assert len(found) > 2
    assert found == {"segments": 0o700} | {name: 0o600 for name in found if name != "segments"}
    kvstore.stop()
    for path in [kvstore.data_dir / "segments", *(kvstore.data_dir / "segments").iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # as a store before this change left them
    kvstore.start()
    found = modes(kvstore)
    assert found == {"segments": 0o700} | {name: 0o600 for name in found if name != "segments"}
