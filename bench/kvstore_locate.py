"""The kvstore's index on a prefix hit: Lookup and LocateBlocks latency against the number of blocks.

A prefix hit asks the store about every block of the prompt in one call: a 32K-token prompt of
the Llama-3.1-8B shape is 2,047 blocks of 16 tokens. Starts a redis-server and a kvstore process
(the test suite's helpers) that serves locations, puts `--max-blocks` small blocks, then times
Lookup and LocateBlocks over the first N of them for each `--blocks` N, `--calls` times each,
after two warm-up calls. The payloads are tiny: the index and the RPC are timed, not the disk.

    .venv/bin/python bench/kvstore_locate.py --out bench/results/kvstore_locate_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name, git_commit
from tests.kvstore.conftest import KVStoreProcess, RedisServer, raw_block


def timed_ms(call: Callable[[], object], num_calls: int) -> list[float]:
    """Wall time of each of `num_calls` calls, after two warm-up calls."""
    for _ in range(2):
        call()
    times = []
    for _ in range(num_calls):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1e3)
    return times


def measure(args: argparse.Namespace) -> list[tuple[int, str, list[float]]]:
    """(blocks, RPC, times in ms) for each block count and RPC."""
    rows: list[tuple[int, str, list[float]]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-locate-") as tmp:
        directory = Path(tmp)
        redis = RedisServer(directory, binary=args.redis_server).start()
        env = {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"}
        kvstore = KVStoreProcess(directory / "kvstore", redis.url, env).start()
        try:
            with kvstore.client("bench-tenant") as client:
                blocks = [raw_block(f"block-{n}", 64) for n in range(max(args.blocks))]
                for start in range(0, len(blocks), 512):
                    client.put(blocks[start : start + 512])
                hashes: list[str] = [b.block_hash for b in blocks]
                for count in args.blocks:
                    wanted = hashes[:count]
                    assert len(client.locate(wanted)) == count
                    lookup = timed_ms(partial(client.lookup, wanted), args.calls)
                    locate = timed_ms(partial(client.locate, wanted), args.calls)
                    rows += [(count, "Lookup", lookup), (count, "LocateBlocks", locate)]
        finally:
            kvstore.stop()
            redis.stop()
    return rows


def table(rows: list[tuple[int, str, list[float]]]) -> str:
    lines = ["| blocks | RPC | p50 ms | p90 ms | min ms |", "| ---: | --- | ---: | ---: | ---: |"]
    for count, name, times in rows:
        ordered = sorted(times)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        lines.append(
            f"| {count} | {name} | {statistics.median(ordered):.1f} | {p90:.1f} | {ordered[0]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 512, 2047, 4096])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--redis-server", type=Path, default=None, help="default: redis-server on PATH")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args()
    rows = measure(args)
    commit = git_commit()
    load = os.getloadavg()[0]
    text = "\n".join(
        [
            "# kvstore index latency on a prefix hit",
            "",
            f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {commit}",
            f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs, load average {load:.1f} at the "
            f"end; Python {platform.python_version()}",
            f"- settings: {args.calls} calls per cell after 2 warm-ups; one kvstore process and one "
            "redis-server on loopback; blocks of 128 B payload",
            "- reproduce: `.venv/bin/python bench/kvstore_locate.py --blocks "
            f"{' '.join(map(str, args.blocks))} --calls {args.calls}`",
            "",
            table(rows),
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
