"""CPU decode benchmark: our engine vs transformers `generate` on the same GGUF weights, same run.

    .venv/bin/python bench/decode_cpu.py                 # SmolLM2-135M-Instruct, batch 1 and 8
    .venv/bin/python bench/decode_cpu.py --batch-sizes 1 --new-tokens 32 --no-write

Both sides run fp32 on the CPU with greedy decoding and EOS ignored, so they do the same work.
TTFT is submit -> first token (prefill of the whole batch); decode tokens/s counts the tokens after
the first, over the time after the first. Results go to bench/results/decode_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name, git_commit  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.model.registry import resolve_model  # noqa: E402
from services.engine.scheduling.sampling_params import SamplingParams  # noqa: E402

SEED_TEXT = (
    "The history of lighthouses begins with fires lit on hilltops to guide ships home. Over centuries, "
    "keepers tended oil lamps, clockwork lenses and finally electric beacons, each change making the "
    "light reach farther into the night. "
)


@dataclass(frozen=True)
class Measurement:
    """One engine at one batch size."""

    engine: str
    batch_size: int
    ttft_ms: float
    decode_tokens_per_s: float
    total_s: float
    token_ids: list[list[int]]


def make_prompts(engine: LLMEngine, batch_size: int, prompt_tokens: int) -> list[list[int]]:
    """`batch_size` different prompts of exactly `prompt_tokens` tokens."""
    ids = engine.tokenizer.encode(SEED_TEXT * (prompt_tokens // 20 + 2), add_bos=False)
    assert len(ids) >= prompt_tokens + batch_size, "seed text too short"
    return [ids[row : row + prompt_tokens] for row in range(batch_size)]


def run_ours(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, name: str = "thermocline"
) -> Measurement:
    """Time one batched `generate` of our engine."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    total_s = time.perf_counter() - start
    ttft_ms = max(r.ttft_ms for r in results)
    decode_s = total_s - ttft_ms / 1e3
    rate = len(prompts) * (new_tokens - 1) / decode_s
    return Measurement(name, len(prompts), ttft_ms, rate, total_s, [list(r.token_ids) for r in results])


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_s: float | None = None

    def put(self, value: Any) -> None:
        self.num_puts += 1
        if self.num_puts == 2:  # the first put is the prompt itself
            self.first_token_s = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(model: Any, prompts: list[list[int]], new_tokens: int) -> Measurement:
    """Time one batched transformers `generate` (equal-length prompts, so no padding)."""
    input_ids = torch.tensor(prompts)
    clock = _FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, streamer=clock,
        )  # fmt: skip
    total_s = time.perf_counter() - start
    assert clock.first_token_s is not None
    ttft_s = clock.first_token_s - start
    rate = len(prompts) * (new_tokens - 1) / (total_s - ttft_s)
    token_ids = out[:, input_ids.shape[1] :].tolist()
    return Measurement(HF_NAME, len(prompts), ttft_s * 1e3, rate, total_s, token_ids)


def median_run(runs: list[Measurement]) -> Measurement:
    """The run with the median decode rate (TTFT is the median too, taken separately)."""
    by_rate = sorted(runs, key=lambda r: r.decode_tokens_per_s)
    middle = by_rate[len(runs) // 2]
    ttft_ms = sorted(r.ttft_ms for r in runs)[len(runs) // 2]
    return replace(middle, ttft_ms=ttft_ms)


def load_hf(path: Path) -> Any:
    """transformers' GGUF loader (dequantizes to fp32, like ours)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def environment(args: argparse.Namespace, model_path: Path) -> dict[str, str]:
    """Everything that affects the numbers."""
    import transformers

    return {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "git commit": git_commit("services/engine", "bench/decode_cpu.py"),
        "cpu": cpu_name(),
        "logical cpus": str(torch.multiprocessing.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"{args.model} ({model_path.name})",
        "dtype": "float32 for both (weights dequantized from Q4_1); extra rows: ours in "
        + (", ".join(args.extra_dtypes) or "none"),
        "prompt tokens": str(args.prompt_tokens),
        "new tokens": f"{args.new_tokens} (greedy, EOS ignored)",
        "batch sizes": ", ".join(map(str, args.batch_sizes)),
        "warm-up": f"one {args.warmup_tokens}-token run per engine and batch size, not timed",
        "repeats": f"{args.repeats} timed runs per engine, interleaved; the table shows the median",
        "load average (1 min) at start / end": f"{args.load_at_start:.2f} / {os.getloadavg()[0]:.2f}",
    }


def markdown(env: dict[str, str], rows: list[Measurement]) -> str:
    """The report: settings, then one table row per engine and batch size, with our/HF ratios."""
    lines = ["# CPU decode: Thermocline engine vs transformers `generate`", ""]
    lines += ["| setting | value |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in env.items()], ""]
    lines += [
        "| batch | engine | TTFT ms | decode tok/s | total s | decode ratio (ours/HF) | TTFT ratio (HF/ours) "
        "| same tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch_size in sorted({r.batch_size for r in rows}):
        group = [r for r in rows if r.batch_size == batch_size]
        hf = next(r for r in group if r.engine == HF_NAME)
        for r in group:
            is_hf = r is hf
            ratio = "" if is_hf else f"{r.decode_tokens_per_s / hf.decode_tokens_per_s:.2f}x"
            ttft = "" if is_hf else f"{hf.ttft_ms / r.ttft_ms:.2f}x"
            same = "" if is_hf else ("yes" if r.token_ids == hf.token_ids else "no")
            lines.append(
                f"| {batch_size} | {r.engine} | {r.ttft_ms:.0f} | {r.decode_tokens_per_s:.1f} "
                f"| {r.total_s:.2f} | {ratio} | {ttft} | {same} |"
            )
    return "\n".join(lines) + "\n"


HF_NAME = "transformers"


def main() -> None:
    """Run both engines at each batch size, print the table, and write the result file."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the median is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--extra-dtypes", nargs="*", default=["bfloat16"], help="also time our engine in these dtypes"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    args = parser.parse_args()
    args.load_at_start = os.getloadavg()[0]  # other work on the machine skews every number
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model)
    max_seq_len = args.prompt_tokens + args.new_tokens + 8
    engines = {
        f"thermocline ({dtype})": LLMEngine.load(
            model_path,
            device="cpu",
            dtype=dtype,
            max_batch_size=max(args.batch_sizes),
            max_seq_len=max_seq_len,
        )
        for dtype in ["float32", *args.extra_dtypes]
    }
    hf = load_hf(model_path)
    rows: list[Measurement] = []
    for batch_size in args.batch_sizes:
        prompts = make_prompts(next(iter(engines.values())), batch_size, args.prompt_tokens)
        runners = {name: partial(run_ours, engine, name=name) for name, engine in engines.items()}
        runners[HF_NAME] = partial(run_hf, hf)
        for run in runners.values():
            run(prompts, args.warmup_tokens)
        trials: dict[str, list[Measurement]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # interleaved, so a noisy moment hits every engine alike
            for name, run in runners.items():
                trials[name].append(run(prompts, args.new_tokens))
        for name, runs in trials.items():
            row = median_run(runs)
            rows.append(row)
            print(
                f"batch {batch_size}: {name} {row.decode_tokens_per_s:.1f} tok/s, TTFT {row.ttft_ms:.0f} ms"
            )
    report = markdown(environment(args, model_path), rows)
    print(report)
    if not args.no_write:
        out = REPO / "bench" / "results" / f"decode_cpu_{dt.date.today().isoformat()}.md"
        out.write_text(report, encoding="utf-8")
        print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
