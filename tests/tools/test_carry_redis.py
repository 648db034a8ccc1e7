"""tools/carry_redis.sh: the folder it fills runs redis-server on its own libraries, and nothing of
glibc's travels (the target supplies it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.kvstore.conftest import ROOT, RedisServer

SCRIPT = ROOT / "tools" / "carry_redis.sh"


@pytest.fixture
def carried(tmp_path: Path) -> tuple[Path, str]:
    """A filled folder (outside the repository: no git-ignore line is written) and what the script printed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    folder = tmp_path / "redis"
    done = subprocess.run([SCRIPT, str(folder)], capture_output=True, text=True, check=True, cwd=tmp_path)
    return folder, done.stdout


def test_the_folder_holds_the_binary_and_its_libraries_but_not_glibc(carried: tuple[Path, str]) -> None:
    folder, printed = carried
    names = {path.name for path in (folder / "lib").iterdir()}
    assert {"redis-server.bin", "libjemalloc.so.2", "liblzf.so.1"} <= names
    assert not names & {"libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"}
    assert printed.strip() == f"export THERMOCLINE_REDIS_SERVER={folder}/redis-server"


def test_its_wrapper_runs_a_server_that_loads_the_carried_libraries(
    carried: tuple[Path, str], tmp_path: Path
) -> None:
    folder, _ = carried
    relative = Path(os.path.relpath(folder / "redis-server"))  # resolved before the server's cwd changes
    server = RedisServer(tmp_path, binary=relative).start()
    try:
        assert server.client().ping()
        assert server.process is not None
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
        assert f"{folder}/lib/libjemalloc.so.2" in maps  # the wrapper execs: the pid is the server's
    finally:
        server.stop()


def test_a_named_binary_that_is_missing_fails_rather_than_skips(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RedisServer(tmp_path, binary=tmp_path / "missing" / "redis-server").start()
