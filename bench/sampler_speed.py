"""Times one sampling step of the engine's sampler against plain PyTorch, per batch shape and setting.

    .venv/bin/python bench/sampler_speed.py --device cuda --out bench/results/sampler_speed_<date>.md

The engine's sampler (services/engine/execution/sampler.py) draws each seeded row from its own
logits, settings and key only: fixed-point weights, exact cumulative sums, a counter-based uniform.
`engine sampler` times the torch code (`sample_reference`, what the engine runs on the CPU); on
CUDA, `engine kernels` times the Triton path (`sample_fused`, sampler_kernel.py, what the engine
runs there) and `rows != reference` counts the rows of the cell where it drew other tokens than the
torch code on the same logits. The baselines are
what a step costs without that promise, on the same logits: `argmax` (greedy), and
`torch.multinomial` over the softmax after the same top-k / top-p filter (one generator for the
batch, so a row's draw depends on its neighbours). `--compare-to FILE` also times another
sampler module with the same `sample` signature (e.g. an earlier version, `git show
<commit>:services/engine/execution/sampler.py > /tmp/old_sampler.py`).

Each cell is the median of `--iters` steps after `--warmup`, timed with CUDA events on the GPU and
perf_counter on the CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.execution import sampler as engine_sampler
from services.engine.scheduling.sampling_params import SamplingParams

SETTINGS: dict[str, Callable[[int], SamplingParams]] = {
    "temperature 0.8": lambda r: SamplingParams(temperature=0.8, seed=r),
    "top-p 0.9": lambda r: SamplingParams(temperature=0.8, top_p=0.9, seed=r),
    "top-k 50": lambda r: SamplingParams(temperature=0.8, top_k=50, seed=r),
    "mixed (thirds)": lambda r: (
        SamplingParams(temperature=0.8, seed=r),
        SamplingParams(temperature=0.8, top_p=0.9, seed=r),
        SamplingParams(temperature=0.8, top_k=50, seed=r),
    )[r % 3],
}


def torch_baseline(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Plain PyTorch: per-row temperature, the same top-k / top-p filter, one multinomial draw."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits / temperature[:, None]
    top_k = torch.tensor([p.top_k or logits.shape[1] for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    ranked, order = scaled.sort(dim=-1, descending=True)
    position = torch.arange(logits.shape[1], device=logits.device)[None, :]
    probs = ranked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep = (position < top_k[:, None]) & (before < top_p[:, None])
    probs = probs.masked_fill(~keep, 0.0)
    picked = torch.multinomial(probs, 1).squeeze(1)
    return order.gather(1, picked[:, None]).squeeze(1)


def rows_off_reference(logits: torch.Tensor, params: list[SamplingParams], keys: list) -> int:
    """How many rows the kernels draw other tokens for than the torch reference does."""
    fused = engine_sampler.sample_fused(logits, params, keys)
    return int((fused != engine_sampler.sample_reference(logits, params, keys)).sum())


def timed(step: Callable[[], torch.Tensor], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of one call of `step`."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def load_module(path: Path) -> ModuleType:
    """A sampler module from a file (an earlier version, for `--compare-to`)."""
    spec = importlib.util.spec_from_file_location("compared_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Times every shape and setting and prints (and writes) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compare-to", type=Path, default=None, help="another sampler module to time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    compared = load_module(args.compare_to) if args.compare_to else None
    generator = torch.Generator(device=device).manual_seed(0)
    kernels = device.type == "cuda"  # the CPU runs them only in Triton's interpreter
    columns = ["argmax", "torch multinomial", "engine sampler"] + (["engine kernels"] if kernels else [])
    columns += ["compared sampler"] if compared else []
    rows = []
    for vocab in args.vocabs:
        for batch in args.batches:
            logits = torch.randn(batch, vocab, device=device, generator=generator) * 4.0
            for name, make in SETTINGS.items():
                params = [make(r) for r in range(batch)]
                keys = [(r, 7) for r in range(batch)]
                steps = [
                    partial(torch.argmax, logits, dim=-1),
                    partial(torch_baseline, logits, params),
                    partial(engine_sampler.sample_reference, logits, params, keys),
                ]
                if kernels:
                    steps.append(partial(engine_sampler.sample_fused, logits, params, keys))
                if compared is not None:
                    steps.append(partial(compared.sample, logits, params, keys))
                cells = [timed(step, device, args.warmup, args.iters) for step in steps]
                differ = str(rows_off_reference(logits, params, keys)) if kernels else "-"
                rows.append((vocab, batch, name, cells, differ))
                timings = ", ".join(f"{c:.3f} ms" for c in cells)
                print(f"V={vocab} B={batch} {name}: {timings}; {differ} rows != reference", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    lines = [
        f"# Sampler step time, {dt.date.today()}",
        "",
        f"- commit `{commit.strip()}` (working tree), device {hardware}, torch {torch.__version__}",
        f"- median of {args.iters} steps after {args.warmup} warm-up steps; logits fp32 N(0, 16)",
        f"- `{' '.join(sys.argv)}`",
        "",
        "| vocab | batch | setting | " + " | ".join(f"{c} (ms)" for c in columns) + " | rows != reference |",
        "| ---: | ---: | --- |" + " ---: |" * (len(columns) + 1),
        *(
            f"| {v} | {b} | {n} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {differ} |"
            for v, b, n, cells, differ in rows
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
