"""Sampling cost per step: the batched sampler against drawing row by row, on the CPU and CUDA.

    .venv/bin/python bench/sampler.py                          # CPU (and CUDA when present)
    python3 bench/sampler.py --devices cuda --out results.md   # on the GPU machine

Every row samples (temperature 0.8 with top-p 0.95, then top-k 50) over a Llama 3 vocabulary
(128,256). `per-row` is the sampler as it was before it was batched (a712e2d): one torch.Generator
per request and about ten operations per row. `batched` is services/engine/execution/sampler.py.
Times are per step (one call), medians of `--repeats` calls after one warm-up, with a device sync
before and after each call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name, git_commit  # noqa: E402
from services.engine.execution.sampler import sample  # noqa: E402
from services.engine.scheduling.sampling_params import SamplingParams  # noqa: E402

VOCAB = 128_256


def sample_per_row(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """The baseline: each sampled row filtered and drawn on its own (the sampler before a712e2d)."""
    token_ids = logits.argmax(dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        scaled = logits[row] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            ranked, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(ranked, dim=-1)
            drop_ranked = torch.cumsum(probs, dim=-1) - probs >= p.top_p
            drop = torch.empty_like(drop_ranked).scatter_(0, order, drop_ranked)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        token_ids[row] = torch.multinomial(probs, num_samples=1, generator=generator)[0]
    return token_ids


def timed(call: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    """Median milliseconds of one call, synchronized."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(device: torch.device, batch: int, params: SamplingParams, repeats: int) -> tuple[float, float]:
    logits = torch.randn(batch, VOCAB, device=device, generator=torch.Generator(device).manual_seed(batch))
    rows = [params] * batch
    generators = [torch.Generator(device).manual_seed(row) for row in range(batch)]
    keys = [(row, 0) for row in range(batch)]
    per_row = timed(lambda: sample_per_row(logits, rows, generators), device, repeats)
    batched = timed(lambda: sample(logits, rows, keys), device, repeats)
    return per_row, batched


def agreement() -> str:
    """How often CUDA draws the CPU's token for the same logits and keys (the hash must not differ)."""
    logits = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_k=50)] * 256
    keys = [(row, 7) for row in range(256)]
    cpu = sample(logits, params, keys)
    cuda = sample(logits.cuda(), params, keys).cpu()
    same = int((cpu == cuda).sum())
    return (
        f"CPU and CUDA draw the same token for {same} of 256 rows with the same keys (T 0.8, top-k 50); "
        "the rest differ by rounding at a cumulative-probability boundary"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "git commit": git_commit("services/engine/execution/sampler.py"),
        "cpu": f"{cpu_name()}, {torch.get_num_threads()} torch threads",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "vocabulary": str(VOCAB),
        "rows": "every row samples; fp32 logits from randn",
        "repeats": f"{args.repeats} timed calls after one warm-up; median",
    }
    lines = ["# Sampler: batched vs row by row", ""]
    lines += ["| setting | value |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in settings.items()], ""]
    lines += [
        "| device | params | batch | per-row ms | batched ms | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in args.devices.split(","):
        device = torch.device(name)
        for label, params in (
            ("T 0.8, top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95)),
            ("T 0.8, top-k 50", SamplingParams(temperature=0.8, top_k=50)),
        ):
            for batch in args.batches:
                per_row, batched = measure(device, batch, params, args.repeats)
                ratio = f"{per_row / batched:.1f}x"
                lines.append(f"| {name} | {label} | {batch} | {per_row:.2f} | {batched:.2f} | {ratio} |")
                print(lines[-1], flush=True)
    if torch.cuda.is_available():
        lines += ["", agreement()]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")


if __name__ == "__main__":
    main()
