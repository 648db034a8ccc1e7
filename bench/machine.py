"""What every results file says about the machine it ran on."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_commit(*paths: str) -> str:
    """The short commit of the tree the run used, and which of `paths` it changed (tracked or not)."""

    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if not paths:
        return commit
    changed = git("diff", "--name-only", "HEAD", "--", *paths).split()
    changed += git("ls-files", "--others", "--exclude-standard", "--", *paths).split()
    return commit + (f" (uncommitted changes: {' '.join(changed)})" if changed else "")


def default_engine_device() -> str:
    """Where a mesh's engine runs when the benchmark leaves its device setting alone: the
    THERMOCLINE_ENGINE_DEVICE of the environment, resolved as the engine resolves it."""
    import os

    from services.engine.model.loader import resolve_device

    chosen = os.environ.get("THERMOCLINE_ENGINE_DEVICE", "auto")
    return f"{resolve_device(chosen)} ({chosen})"
