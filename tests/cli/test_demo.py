"""`thermocline demo`, as a newcomer runs it: the whole mesh with SmolLM2, one chat, the trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_answers_paris_and_prints_every_hop(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "services.cli.main", "--state-dir", str(tmp_path), "demo"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = done.stdout.split("asking:", 1)[1].split("trace id", 1)[0]
    assert "Paris" in answer
    for hop in (
        "gateway: /thermocline.gateway.v1",
        "safety: /thermocline.safety.v1",
        "engine: /thermocline.engine.v1",
    ):
        assert hop in done.stdout, done.stdout
