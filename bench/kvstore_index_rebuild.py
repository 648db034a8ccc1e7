"""How long the kvstore's Redis index takes to rebuild, per block count (the Redis part alone).

A rebuild (services/kvstore/index.py `RedisIndex.rebuild`, after Redis lost or rolled back the
index) holds the store's writes and every call that meets the stale index until it ends. It clears
the old index under the store's prefix, then writes one entry per live block. This times both
cases on a private `redis-server` over a unix socket, with made-up entries (the segment scan that
finds them is not timed): over an empty Redis (the index was lost), and over a full index of the
same blocks (it was rolled back to an older copy, so every key is cleared first).

    .venv/bin/python bench/kvstore_index_rebuild.py --out bench/results/kvstore_index_rebuild_<date>.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.kvstore.index import IndexEntry, RedisIndex
from services.kvstore.segments import Location


async def _ready(client: aioredis.Redis) -> None:
    """Returns once the server answers PING (it opens its socket a moment after it starts)."""
    for _ in range(500):
        try:
            await client.ping()
            return
        except (ConnectionError, OSError, aioredis.ConnectionError):
            await asyncio.sleep(0.01)
    raise RuntimeError("redis-server did not answer")


async def time_rebuilds(num_blocks: int) -> tuple[float, float]:
    """Seconds for a rebuild over an empty Redis, then over a full index of the same blocks."""
    with tempfile.TemporaryDirectory() as directory:
        socket = os.path.join(directory, "redis.sock")
        server = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", socket, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        client = aioredis.Redis(unix_socket_path=socket)
        try:
            await _ready(client)
            index = RedisIndex(client, "kv:")
            entries = {
                os.urandom(32): IndexEntry(Location(i // 100, (i % 100) * 4096, 4096), 0, "tenant", i)
                for i in range(num_blocks)
            }
            started = time.perf_counter()
            await index.rebuild(entries)
            empty = time.perf_counter() - started
            started = time.perf_counter()
            await index.rebuild(entries)
            return empty, time.perf_counter() - started
        finally:
            await client.aclose()
            server.terminate()
            server.wait()


def _output(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


def main() -> None:
    """Prints one markdown table; `--out` also writes it with the settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10_000, 40_000])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    commit = _output(["git", "rev-parse", "--short", "HEAD"])
    redis_version = _output(["redis-server", "--version"]).split(" sha=")[0]
    lines = [
        f"# kvstore index rebuild, {dt.date.today().isoformat()}",
        "",
        f"- commit `{commit}`; {platform.machine()}, {os.cpu_count()} CPUs; {redis_version}",
        f"- `bench/kvstore_index_rebuild.py --blocks {' '.join(map(str, args.blocks))}`: one run each",
        "",
        "| blocks | over an empty Redis (s) | over a full index (s) |",
        "| ---: | ---: | ---: |",
    ]
    for num_blocks in args.blocks:
        empty, full = asyncio.run(time_rebuilds(num_blocks))
        lines.append(f"| {num_blocks:,} | {empty:.2f} | {full:.2f} |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
