"""The engine's host time per decode step, and how much of it sits on the step's critical path.

    .venv/bin/python bench/host_overhead.py                       # batch 64 and 256, stories260K
    .venv/bin/python bench/host_overhead.py --batch-sizes 256 --no-write

On a GPU, a decode step's time is the device's work plus the host work the device waits for:
from the step's one sync (sampled tokens reach the host) to the next launch. At large batches that
host work is per-row Python (commit, detokenize, schedule, build the step's metadata), and it is
what separates a fast kernel from a fast engine. This benchmark measures it on the CPU with a tiny
model (stories260K), whose forward pass is small next to the host work:

- `model`: the model's forward (device work on a GPU);
- `text`: detokenizing, stop strings and events (`LLMEngine._flush_text`);
- `ahead`: scheduling and preparing the next step (`LLMEngine._schedule_ahead`: its rows, block
  tables and metadata);
- `commit_computed`, `record_attention`: per-row bookkeeping after the launch.

All of these run between a step's launch and its sync, so on a GPU they overlap the device's
work. `critical host` is the rest of the step: the host time a GPU waits for (taking the tokens,
launching, the sampler's launch, the inbox). The other columns break it down.

The engine's methods are timed by wrapping them on the instance; the wrappers cost well under a
microsecond per call. A tree without `_flush_text` or `_schedule_ahead` (before that work left the
critical path) reports them as 0, their work inside `commit` and the next step. Results go to
bench/results/host_overhead_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "protos"))

from bench.machine import cpu_name, git_commit  # noqa: E402
from services.engine.kv.tiers import KVCacheSpec, TierConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.model.registry import resolve_model  # noqa: E402
from services.engine.scheduling.sampling_params import SamplingParams  # noqa: E402

# --tiers: the GPU benchmark's tiers-on setting (bench/decode_gpu.py), warm covering the context
TIERS = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=40_000, group_size=32)

# (label, object path on the engine, method): each is timed per step. `model` and `text` are the
# split the report is about; the others break the critical host time down.
TIMED = (
    ("model", "runner.model", "forward"),
    ("text", "", "_flush_text"),
    ("ahead", "", "_schedule_ahead"),  # the next step scheduled and prepared during this one
    ("schedule", "scheduler", "schedule"),
    ("commit", "", "_commit"),
    ("commit_computed", "scheduler", "commit_computed"),
    ("record_attention", "", "_record_attention"),
)
# what runs between a step's launch and its sync, beside the device on a GPU
OVERLAPPED = ("model", "text", "ahead", "commit_computed", "record_attention")


def _timed(totals: Counter[str], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    return wrapper


def instrument(engine: LLMEngine) -> Counter[str]:
    """Wrap the timed methods on this engine instance; returns the seconds each accumulates."""
    totals: Counter[str] = Counter()
    for label, path, name in TIMED:
        owner: Any = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        if hasattr(owner, name):
            setattr(owner, name, _timed(totals, label, getattr(owner, name)))
    return totals


def measure(engine: LLMEngine, batch_size: int, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step: the step, and each timed part, for one batched generate."""
    prompts = [[1] + [(row * 7 + i) % 500 + 2 for i in range(prompt_tokens - 1)] for row in range(batch_size)]
    totals = instrument(engine)
    # the prefill step is timed apart and left out: this is about decode steps
    engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    totals.clear()
    steps_before = engine.stats().num_steps
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    total_s = time.perf_counter() - start
    # the prefill of the second generate is one of the steps; new_tokens - 1 are decode steps
    steps = engine.stats().num_steps - steps_before
    per_step = {label: seconds * 1e3 / steps for label, seconds in totals.items()}
    per_step["step"] = total_s * 1e3 / steps
    per_step["critical host"] = per_step["step"] - sum(per_step.get(label, 0.0) for label in OVERLAPPED)
    per_step["steps"] = steps
    return per_step


def environment(args: argparse.Namespace) -> dict[str, str]:
    """Everything that affects the numbers."""
    return {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "git commit": git_commit("services/engine", "bench/host_overhead.py"),
        "cpu": cpu_name(),
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": "stories260K (the shared TinyStories Llama), float32, CPU",
        "tiers": str(TIERS) if args.tiers else "off",
        "prompt tokens": str(args.prompt_tokens),
        "new tokens": f"{args.new_tokens} (greedy, EOS ignored); a 1-token generate first, untimed",
        "batch sizes": ", ".join(map(str, args.batch_sizes)),
        "repeats": f"{args.repeats} per batch size; the table shows the median of each column",
        "load average (1 min) at start / end": f"{args.load_at_start:.2f} / {os.getloadavg()[0]:.2f}",
    }


COLUMNS = (
    "step", "model", "text", "ahead", "commit_computed", "record_attention", "critical host",
    "schedule", "commit",
)  # fmt: skip


def markdown(env: dict[str, str], rows: dict[int, dict[str, float]]) -> str:
    """The settings, then one row per batch size (ms per decode step)."""
    lines = ["# Engine host time per decode step (CPU)", ""]
    lines += ["| setting | value |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in env.items()], ""]
    lines += [
        "Milliseconds per step. `model` to `record_attention` run between a step's launch and its "
        "sync, beside the device on a GPU; `critical host` = step - those: the host work a GPU "
        "waits for. `schedule` counts every call, ahead or not.",
        "",
        "| batch | " + " | ".join(COLUMNS) + " | critical host per row (µs) |",
        "| --- | " + " | ".join("---" for _ in COLUMNS) + " | --- |",
    ]
    for batch_size, row in sorted(rows.items()):
        cells = " | ".join(f"{row.get(c, 0.0):.2f}" for c in COLUMNS)
        lines.append(f"| {batch_size} | {cells} | {row['critical host'] * 1e3 / batch_size:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the host work is Python)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--suffix", default="", help="appended to the result file's name")
    parser.add_argument(
        "--tiers", action="store_true",
        help="tiers on (sink 4, hot window 128, INT4 warm, group 32): give a prompt past 128 tokens",
    )  # fmt: skip
    args = parser.parse_args()
    args.load_at_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model = resolve_model("stories260K")
    kv = KVCacheSpec(tiers=TIERS) if args.tiers else KVCacheSpec()
    rows: dict[int, dict[str, float]] = {}
    for batch_size in args.batch_sizes:
        runs = []
        for _ in range(args.repeats):
            engine = LLMEngine.load(
                model, device="cpu", dtype="float32", max_batch_size=batch_size,
                max_seq_len=args.prompt_tokens + args.new_tokens + 8, progress=False, kv=kv,
            )  # fmt: skip
            try:
                runs.append(measure(engine, batch_size, args.prompt_tokens, args.new_tokens))
            finally:
                engine.stop()
        rows[batch_size] = {key: statistics.median(r.get(key, 0.0) for r in runs) for key in runs[0]}
    report = markdown(environment(args), rows)
    print(report)
    if not args.no_write:
        day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
        out = REPO / "bench" / "results" / f"host_overhead_{day}{args.suffix}.md"
        out.write_text(report, encoding="utf-8")
        print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
