"""The kvstore's disk path: write and read throughput of the real service against `dd` on the same disk.

Starts a redis-server and a kvstore process (the test suite's helpers in tests/kvstore/conftest.py)
over a data directory on the disk under test, then:
- `dd`: sequential write of `--dd-mb` MiB with one fdatasync at the end, then a read of it with
  O_DIRECT (the page cache bypassed): the disk's ceiling;
- puts: `--clients` threads each stream PutBlocks of `--batch` blocks of `--block-kb` KiB until
  `--total-mb` MiB are acknowledged (each reply only after its fsync), per fsync policy;
- gets: the same blocks read back by GetBlocks in batches of `--batch` from `--clients` threads
  (the segments are in the page cache by then, as they would be on a store of this size), and
  again after a Prefetch has staged them in RAM.

    .venv/bin/python bench/kvstore_store.py --out bench/results/kvstore_store_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from services.kvstore.blocks import BlockIn, Codec
from services.kvstore.keys import BlockHash
from tests.kvstore.conftest import KVStoreProcess, RedisServer

MIB = 1024 * 1024


@dataclass(frozen=True)
class Throughput:
    """One measured phase."""

    phase: str
    mib_per_s: float
    p50_ms: float | None = None
    p99_ms: float | None = None


def dd_throughput(directory: Path, size_mb: int) -> list[Throughput]:
    """Sequential write (with fdatasync) and O_DIRECT read of one file, as `dd` reports them."""
    path = directory / "dd.bin"
    write = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "conv=fdatasync"]
    read = ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"]
    results = [
        Throughput("dd write (fdatasync)", _dd_rate(write)),
        Throughput("dd read (O_DIRECT)", _dd_rate(read)),
    ]
    path.unlink()
    return results


def _dd_rate(command: list[str]) -> float:
    """MiB/s from dd's own summary line (bytes copied, seconds)."""
    output = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", output)
    assert match is not None, output
    return int(match.group(1)) / float(match.group(2)) / MIB


def make_blocks(num_blocks: int, block_bytes: int) -> list[BlockIn]:
    """Blocks of incompressible bytes with distinct hashes."""
    blocks = []
    for n in range(num_blocks):
        payload = os.urandom(block_bytes)
        block_hash = BlockHash(f"{n:064x}")
        blocks.append(BlockIn(block_hash, Codec.RAW, (block_bytes // 2,), payload))
    return blocks


def batches(blocks: list[BlockIn], size: int) -> list[list[BlockIn]]:
    """Consecutive batches of `size` blocks."""
    return [blocks[start : start + size] for start in range(0, len(blocks), size)]


def timed_calls(kvstore: KVStoreProcess, work: list, call, clients: int) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    """Runs `call(client, item)` for every item on `clients` threads; (seconds, per-call seconds)."""
    latencies: list[float] = []

    def worker(items: list) -> None:  # type: ignore[type-arg]
        with kvstore.client(chunk_bytes=MIB) as client:
            for item in items:
                started = time.perf_counter()
                call(client, item)
                latencies.append(time.perf_counter() - started)

    shares = [work[n::clients] for n in range(clients)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, shares))
    return time.perf_counter() - started, latencies


def phase(name: str, num_bytes: int, seconds: float, latencies: list[float]) -> Throughput:
    """A phase's throughput and per-call latency percentiles."""
    quantiles = statistics.quantiles(latencies, n=100)
    return Throughput(name, num_bytes / seconds / MIB, 1000 * quantiles[49], 1000 * quantiles[98])


def store_throughput(directory: Path, policy: str, args: argparse.Namespace) -> list[Throughput]:
    """Puts, disk gets and staged gets through one kvstore process under one fsync policy."""
    block_bytes = args.block_kb * 1024
    blocks = make_blocks(args.total_mb * MIB // block_bytes, block_bytes)
    total = len(blocks) * block_bytes
    redis = RedisServer(directory).start()
    env = {"THERMOCLINE_KVSTORE_FSYNC": policy, "THERMOCLINE_KVSTORE_STAGING_MB": str(2 * args.total_mb)}
    kvstore = KVStoreProcess(directory / f"kvstore-{policy}", redis.url, env).start()
    try:
        put_batches = batches(blocks, args.batch)
        seconds, latencies = timed_calls(kvstore, put_batches, lambda c, b: c.put(b), args.clients)
        results = [phase(f"kvstore put, fsync={policy}", total, seconds, latencies)]
        hash_batches = [[b.block_hash for b in batch] for batch in put_batches]
        seconds, latencies = timed_calls(
            kvstore, hash_batches, lambda c, h: _check(c.get(h), len(h)), args.clients
        )
        results.append(phase("kvstore get, from segments (page cache warm)", total, seconds, latencies))
        with kvstore.client() as client:
            for hashes in hash_batches:
                client.prefetch(hashes)
        seconds, latencies = timed_calls(
            kvstore, hash_batches, lambda c, h: _check(c.get(h), len(h)), args.clients
        )
        results.append(phase("kvstore get, staged by Prefetch", total, seconds, latencies))
        return results
    finally:
        kvstore.stop()
        redis.stop()


def _check(fetched: dict, expected: int) -> None:  # type: ignore[type-arg]
    assert len(fetched) == expected and all(hasattr(f, "payload") for f in fetched.values())


def environment(directory: Path) -> dict[str, str]:
    """Date, commit, machine and the disk under test."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "services/kvstore", "bench/kvstore_store.py"],
        capture_output=True,
        text=True,
    ).stdout
    disk = subprocess.run(
        ["df", "-h", "--output=source,fstype,size", str(directory)], capture_output=True, text=True
    )
    cpu = cpu_name()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + (" (kvstore files modified)" if dirty else ""),
        "hardware": f"CPU {cpu}, {os.cpu_count()} logical CPUs",
        "disk": " ".join(disk.stdout.split()[3:]) or "unknown",
    }


def to_markdown(args: argparse.Namespace, env: dict[str, str], rows: list[Throughput]) -> str:
    """The results file."""
    lines = [
        "# kvstore disk path: the service against dd on the same disk",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}; disk under test: {env['disk']} (`{args.dir or 'system temp dir'}`)",
        f"- settings: blocks of {args.block_kb} KiB (random bytes), {args.batch} per PutBlocks/GetBlocks "
        "call, "
        f"{args.clients} client threads, {args.total_mb} MiB per phase; dd {args.dd_mb} MiB in 1 MiB blocks; "
        "kvstore defaults otherwise (256 MiB segments, 2 ms fsync batch window, 1 MiB reply chunks)",
        "- latency: per call (one batch), p50 and p99",
        f"- reproduce: `.venv/bin/python bench/kvstore_store.py --block-kb {args.block_kb} "
        f"--batch {args.batch} "
        f"--clients {args.clients} --total-mb {args.total_mb} --dd-mb {args.dd_mb}`",
        "",
        "| phase | MiB/s | p50 ms per call | p99 ms per call |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        p50 = f"{row.p50_ms:.1f}" if row.p50_ms is not None else "—"
        p99 = f"{row.p99_ms:.1f}" if row.p99_ms is not None else "—"
        lines.append(f"| {row.phase} | {row.mib_per_s:,.0f} | {p50} | {p99} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kb", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--total-mb", type=int, default=256)
    parser.add_argument("--dd-mb", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk under test")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        directory = Path(scratch)
        rows = dd_throughput(directory, args.dd_mb)
        for policy in ("batch", "always"):
            rows += store_throughput(directory, policy, args)
            print(rows[-3:], flush=True)
        markdown = to_markdown(args, environment(directory), rows)
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")
    print(markdown)


if __name__ == "__main__":
    main()
