"""The fuzz suite (tests/fuzz/) run long: many more examples per property, from a recorded random seed.

    .venv/bin/python bench/fuzz.py       # 500 examples per test; writes bench/results/fuzz_<date>.md
    .venv/bin/python bench/fuzz.py --examples 50 --no-write

CI runs the same tests with 20 derandomized examples each. Here Hypothesis draws from `--seed` (a
random one unless given; the report records it, so `--seed` repeats a run), and the report counts
every call each RPC got, by the status it ended with, and lists any test that failed with its
pytest summary line. A failing example is printed by pytest with the blob that reproduces it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=500, help="Hypothesis examples per test")
    parser.add_argument("--seed", type=int, help="Hypothesis seed (default: a random one, recorded)")
    parser.add_argument("--no-write", action="store_true", help="print the report instead of writing it")
    return parser.parse_args()


def run_suite(examples: int, seed: int, counts_path: Path) -> tuple[int, float, list[str]]:
    """pytest over tests/fuzz: its exit status, wall time, and its failure and summary lines."""
    env = os.environ | {
        "THERMOCLINE_FUZZ_EXAMPLES": str(examples),
        "THERMOCLINE_FUZZ_RANDOM": "1",
        "THERMOCLINE_FUZZ_COUNTS": str(counts_path),
    }
    command = [str(PYTHON), "-m", "pytest", "-q", "--no-header", "-p", "no:cacheprovider", "-rfE"]
    command += [f"--hypothesis-seed={seed}", "tests/fuzz"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    tail = [line for line in result.stdout.splitlines() if line.strip()][-1:]
    return result.returncode, time.monotonic() - started, lines + tail


def calls_table(counts: list[dict]) -> tuple[str, int]:
    """One row per RPC: calls by status; and the total number of calls."""
    by_rpc: dict[str, dict[str, int]] = defaultdict(dict)
    for row in counts:
        by_rpc[row["rpc"]][row["status"]] = row["calls"]
    statuses = sorted({row["status"] for row in counts})
    lines = [
        "| rpc | calls | " + " | ".join(statuses) + " |",
        "| --- | --- | " + " | ".join("---" for _ in statuses) + " |",
    ]
    for rpc, by_status in by_rpc.items():
        cells = " | ".join(str(by_status.get(s, 0)) for s in statuses)
        lines.append(f"| {rpc} | {sum(by_status.values())} | {cells} |")
    return "\n".join(lines), sum(row["calls"] for row in counts)


def num_tests(lines: list[str]) -> int:
    """How many tests pytest ran, from its summary line ("58 passed, 2 failed in ...")."""
    summary = lines[-1] if lines else ""
    return sum(int(n) for n in re.findall(r"(\d+) (?:passed|failed|errors?|skipped)", summary))


def rpcs_of(counts: list[dict]) -> set[str]:
    """The RPCs that got calls."""
    return {row["rpc"] for row in counts}


def git_commit() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "services"], capture_output=True, text=True, cwd=REPO
    )
    return commit.stdout.strip() + (" (services/ has uncommitted changes)" if dirty.stdout.strip() else "")


def report(
    args: argparse.Namespace, seed: int, outcome: tuple[int, float, list[str]], counts: list[dict]
) -> str:
    """The markdown report."""
    return_code, wall_s, lines = outcome
    table, total = calls_table(counts)
    verdict = "every property held" if return_code == 0 else "failures (below)"
    return "\n".join(
        [
            "# Fuzzing every RPC through a real mesh (tests/fuzz, long run)",
            "",
            "| setting | value |",
            "| --- | --- |",
            f"| date (UTC) | {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} |",
            f"| git commit | {git_commit()} |",
            f"| machine | {os.cpu_count()} logical cpus; 1-min load {os.getloadavg()[0]:.1f} at the end |",
            "| mesh | redis-server, kvstore, safety, engine (stories260K), gateway on loopback |",
            f"| examples per test | {args.examples} ({num_tests(lines)} tests over "
            f"{len(rpcs_of(counts))} RPCs) |",
            f"| Hypothesis seed | {seed} |",
            f"| wall time | {wall_s:.0f} s |",
            f"| calls made | {total} |",
            f"| result | {verdict} |",
            "",
            "## Calls by RPC and status",
            "",
            "RPCs whose request has no fields get one example per structured test (there is only one).",
            "",
            table,
            "",
            "## pytest",
            "",
            *(f"    {line}" for line in lines),
            "",
            f"Reproduce: `.venv/bin/python bench/fuzz.py --examples {args.examples} --seed {seed}`",
            "",
        ]
    )


def main() -> int:
    args = parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    with tempfile.TemporaryDirectory() as tmp:
        counts_path = Path(tmp) / "counts.json"
        outcome = run_suite(args.examples, seed, counts_path)
        counts = json.loads(counts_path.read_text()) if counts_path.exists() else []
    text = report(args, seed, outcome, counts)
    if args.no_write:
        print(text)
    else:
        path = REPO / "bench" / "results" / f"fuzz_{dt.datetime.now(dt.UTC):%Y-%m-%d}.md"
        path.write_text(text)
        print(f"wrote {path}")
    return outcome[0]


if __name__ == "__main__":
    sys.exit(main())
