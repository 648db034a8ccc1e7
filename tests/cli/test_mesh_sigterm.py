"""A launcher killed by SIGTERM (a `timeout` around a bench, a CI job's end) stops its mesh on the
way out: no service, engine or redis-server is left running, holding ports and memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# Starts a mesh, prints its processes' pids once every one is healthy, then waits on stdin.
LAUNCHER = """
import json, sys
from pathlib import Path
from services.cli.mesh import Mesh, MeshConfig, Ports
config = MeshConfig(model=sys.argv[1], state_dir=Path(sys.argv[2]), ports=Ports.free(), startup_timeout_s=300)
with Mesh(config) as mesh:
    print(json.dumps({name: process.pid for name, process in mesh.processes.items()}), flush=True)
    sys.stdin.read()
"""


def _is_running(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def _is_mesh_process(pid: int) -> bool:
    """Whether `pid` is still a running service or redis-server (not a process that reused it)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    return _is_running(pid) and (b"services." in command or b"redis-server" in command)


def test_sigterm_to_the_launcher_stops_every_process_of_its_mesh(stories_model: Path, tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(stories_model), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: dict[str, int] = {}
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert {"redis", "kvstore", "safety", "engine", "gateway"} <= set(pids)
        assert all(_is_running(pid) for pid in pids.values())
        launcher.send_signal(signal.SIGTERM)
        # the launcher exits once its mesh has stopped: stop() waits for every process it signals
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
        left_running = [name for name, pid in pids.items() if _is_running(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids.values():  # a failed run must not leave its mesh behind either
            if _is_mesh_process(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert left_running == []
