"""Same-host reads of kvstore records (services/common/segment_reader.py): throughput against the
piece size a payload is read and checksummed in, and the reader threads.

Writes `--blocks` records of `--block-mb` MB each (the 8B shape's 16-token block is 2.1 MB) into one
segment file with the store's own record format, then reads all of them back into one buffer with a
SegmentReader, every record checked, once per setting (best of `--repeats`, after one warm-up read).
The file was just written, so the reads come from the page cache, as a prefix hit's reads of a store
that wrote them recently. Two lines without checks bound it from above: plain `preadv` into the same
buffer (the copy alone), and each record version's checksum over the buffer once it is read
(the checksum alone: zlib's CRC-32 for version 1, CRC-32C for version 2, which the store writes).

    .venv/bin/python bench/segment_reads.py --blocks 256
    python3 bench/segment_reads.py --blocks 2047 --out $OUT/segment_reads.md   # on the H200
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name, git_commit
from services.common.kvstore_api import BlockLocation, Codec
from services.common.segment_reader import ExpectedRecord, SegmentReader
from services.kvstore.keys import BlockHash, StoreKey
from services.kvstore.record import Record

TENANT, MODEL = "bench-tenant", "bench-model"


def write_segment(path: Path, num_blocks: int, payload_bytes: int) -> list[BlockLocation]:
    """One segment of `num_blocks` RAW records of random payloads; their locations."""
    locations = []
    offset = 0
    payload = os.urandom(payload_bytes)
    with path.open("wb") as file:
        for index in range(num_blocks):
            name = f"{index:064x}"
            record = Record(
                StoreKey(index.to_bytes(32, "little")), TENANT, MODEL, BlockHash(name), int(Codec.RAW),
                (payload_bytes // 2,), payload, created_us=0,
            )  # fmt: skip
            data = record.encode(segment_id=1, offset=offset)
            file.write(data)
            locations.append(BlockLocation(name, Codec.RAW, str(path), 1, offset, len(data)))
            offset += len(data)
    return locations


def best_gbps(read: object, num_bytes: int, repeats: int) -> float:
    """GB/s of the fastest of `repeats` calls of `read` (after one warm-up call)."""
    assert callable(read)
    read()
    best = min(_timed(read) for _ in range(repeats))
    return num_bytes / best / 1e9


def _timed(read: object) -> float:
    assert callable(read)
    began = time.perf_counter()
    read()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-mb", type=float, default=2.097152)
    parser.add_argument("--threads", type=int, nargs="+", default=[min(16, os.cpu_count() or 1)])
    parser.add_argument("--pieces-kb", type=int, nargs="+", default=[0, 1024, 256, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the segment goes (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()

    payload_bytes = int(args.block_mb * 1e6) // 2 * 2
    lines = [
        "# Same-host record reads: piece size and threads",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {git_commit('services')}",
        f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}",
        f"- settings: {args.blocks} records of {payload_bytes:,} B, one segment file, read from the page "
        f"cache; best of {args.repeats} after one warm-up read",
        f"- reproduce: `python bench/segment_reads.py --blocks {args.blocks} --block-mb {args.block_mb} "
        f"--threads {' '.join(map(str, args.threads))} --pieces-kb {' '.join(map(str, args.pieces_kb))}`",
        "",
        "| threads | reads | GB/s |",
        "| ---: | --- | ---: |",
    ]
    with tempfile.TemporaryDirectory(prefix="segment-reads-", dir=args.dir) as tmp:
        locations = write_segment(Path(tmp) / "bench.seg", args.blocks, payload_bytes)
        buffer = bytearray(args.blocks * payload_bytes)
        flat = memoryview(buffer)
        payloads = [flat[i * payload_bytes : (i + 1) * payload_bytes] for i in range(args.blocks)]
        expected = ExpectedRecord(TENANT, MODEL, Codec.RAW, (payload_bytes // 2,))
        total = args.blocks * payload_bytes
        descriptor = os.open(locations[0].segment_path, os.O_RDONLY)
        try:
            for threads in args.threads:
                with ThreadPoolExecutor(threads) as pool:

                    def plain(pool: ThreadPoolExecutor = pool) -> None:
                        def one(i: int) -> int:
                            head = bytearray(locations[i].length - payload_bytes)
                            return os.preadv(descriptor, [head, payloads[i]], locations[i].offset)

                        list(pool.map(one, range(args.blocks)))

                    def crc_only(pool: ThreadPoolExecutor = pool) -> None:
                        list(pool.map(zlib.crc32, payloads))

                    rows = [
                        ("preadv only, no check", plain),
                        ("CRC-32 (zlib, record version 1) only, of read payloads", crc_only),
                    ]
                    try:  # the version 2 checksum (a dependency of the store since 8fc5526)
                        import crc32c

                        def crc32c_only(pool: ThreadPoolExecutor = pool) -> None:
                            list(pool.map(crc32c.crc32c, payloads))

                        rows.append(("CRC-32C (crc32c, version 2) only, of read payloads", crc32c_only))
                    except ImportError:
                        pass
                    for piece_kb in args.pieces_kb:
                        reader = SegmentReader(threads, piece_kb << 10)

                        def checked(reader: SegmentReader = reader) -> None:
                            assert reader.read_run(locations, payloads, expected) == args.blocks

                        label = (
                            "whole payload, then CRC"
                            if piece_kb == 0
                            else f"pieces of {piece_kb} KB, CRC each"
                        )
                        rows.append((f"checked: {label}", checked))
                    for label, read in rows:
                        gbps = best_gbps(read, total, args.repeats)
                        lines.append(f"| {threads} | {label} | {gbps:.1f} |")
                        print(lines[-1], flush=True)
        finally:
            os.close(descriptor)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
