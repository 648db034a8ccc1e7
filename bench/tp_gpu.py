"""Tensor parallelism on GPUs with NCCL: TP=2 against TP=1 for greedy output and decode speed.

Needs two CUDA GPUs (e.g. the device tool's nvidia-h200-x2). Checks greedy tokens on stories260K
in fp32 (tiers off and on: TP=2 must equal TP=1), then greedy agreement and decode tokens/s of the
Llama-3.2-1B shape with random bf16 weights at TP=1 and TP=2, timed over pure decode steps the way
bench/decode_gpu.py times them. Writes one markdown table.

    python bench/tp_gpu.py --out $OUT/tp_gpu.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gpu import TIERS_ON, guarded, header, our_decode
from gpu_first_reading import LLAMA_1B, STORIES_PROMPTS, _common_prefix, greedy_ids, make_dummy_1b

from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine, SamplingParams
from services.engine.model.registry import resolve_model


def _load(path: Path, tp: int, dtype: str, **kwargs: object) -> LLMEngine:
    return LLMEngine.load(path, device="cuda", dtype=dtype, progress=False, tp=tp, **kwargs)  # type: ignore[arg-type]


def check_stories(rows: list[str]) -> None:
    """stories260K fp32 on CUDA: TP=2 (NCCL) must give TP=1's greedy tokens, tiers off and on."""
    for label, kv, new_tokens in (
        ("tiers off", KVCacheSpec(), 64),
        ("tiers on, hot 128", KVCacheSpec(tiers=TIERS_ON), 256),
    ):
        outputs = {}
        for tp in (1, 2):
            engine = _load(resolve_model("stories260k"), tp, "float32", max_batch_size=4, kv=kv)
            outputs[tp] = greedy_ids(engine, STORIES_PROMPTS, new_tokens)
            engine.stop()
        agree = [_common_prefix(a, b) for a, b in zip(outputs[1], outputs[2], strict=True)]
        verdict = "identical" if outputs[1] == outputs[2] else "differs"
        rows.append(
            f"| stories260K fp32, batch 4, {new_tokens} greedy tokens, {label} | TP=1 vs TP=2 (NCCL) "
            f"| {verdict} | tokens agreeing per prompt: {agree} |"
        )


def bench_1b(rows: list[str], workdir: Path, args: argparse.Namespace) -> None:
    """The 1B shape in bf16: greedy agreement TP=1 vs TP=2, then decode tokens/s per batch."""
    path = workdir / "llama-3.2-1b-shape"
    make_dummy_1b(path)
    max_seq_len = args.prompt_len + args.new_tokens + 8
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, LLAMA_1B["vocab_size"], (4, 64), generator=generator).tolist()
    speeds: dict[tuple[int, int], tuple[float, float] | str] = {}
    greedy: dict[int, list[tuple[int, ...]]] = {}
    for tp in (1, 2):
        engine = _load(path, tp, "bfloat16", max_batch_size=max(args.batches), max_seq_len=max_seq_len)
        greedy[tp] = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=32))]
        for batch in args.batches:
            speeds[(tp, batch)] = guarded(
                lambda b=batch, e=engine: our_decode(
                    e, LLAMA_1B["vocab_size"], b, args.prompt_len, args.new_tokens
                )
            )
        engine.stop()
        del engine
        torch.cuda.empty_cache()
    control = fp32_greedy(path, prompts, max_seq_len) if greedy[1] != greedy[2] else None
    rows.append(
        "| Llama-3.2-1B shape bf16 (random), batch 4, 32 greedy tokens | TP=1 vs TP=2 (NCCL) | "
        f"{'identical' if greedy[1] == greedy[2] else 'differs'} | {agreement(greedy, control)} |"
    )
    rows.append("\n| batch | TP | decode tok/s | vs TP=1 | median TTFT ms |")
    rows.append("| ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        base = speeds[(1, batch)]
        for tp in (1, 2):
            result = speeds[(tp, batch)]
            if isinstance(result, str):
                rows.append(f"| {batch} | {tp} | failed: {result} | | |")
                continue
            ratio = f"{result[0] / base[0]:.2f}" if not isinstance(base, str) else "n/a"
            rows.append(f"| {batch} | {tp} | {result[0]:.0f} | {ratio} | {result[1]:.1f} |")


def fp32_greedy(path: Path, prompts: list[list[int]], max_seq_len: int) -> dict[int, list[tuple[int, ...]]]:
    """The same prompts and weights in fp32 at TP=1 and TP=2: the control for a bf16 mismatch."""
    greedy = {}
    for tp in (1, 2):
        engine = _load(path, tp, "float32", max_batch_size=len(prompts), max_seq_len=max_seq_len)
        greedy[tp] = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=32))]
        engine.stop()
        del engine
        torch.cuda.empty_cache()
    return greedy


def agreement(bf16: dict[int, list[tuple[int, ...]]], fp32: dict[int, list[tuple[int, ...]]] | None) -> str:
    """Tokens agreeing per prompt, and what the fp32 control says about a bf16 mismatch.

    Only a control can tell rounding from a sharding error: bf16 rounds each rank's partial sums
    before the all-reduce, fp32 does not, so a correct sharding agrees in fp32 where bf16 may part.
    """
    agree = [_common_prefix(a, b) for a, b in zip(bf16[1], bf16[2], strict=True)]
    if fp32 is None:
        return f"tokens agreeing per prompt: {agree}"
    fp32_agree = [_common_prefix(a, b) for a, b in zip(fp32[1], fp32[2], strict=True)]
    if fp32[1] == fp32[2]:
        reading = "fp32 control identical, so the bf16 divergence is rounding of the partial sums"
    else:
        reading = "fp32 control differs too: not explained by bf16 rounding, check the sharding"
    return f"tokens agreeing per prompt: {agree}; fp32 TP=1 vs TP=2: {fp32_agree} ({reading})"


def main() -> None:
    """Runs the checks and the timing; prints the table and writes it to --out."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="decode runs per setting (for the header)")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"this benchmark needs 2 GPUs, found {torch.cuda.device_count()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = header(args)
    rows[0] = "# Tensor parallelism on GPUs (NCCL): TP=2 against TP=1"
    rows = [r for r in rows if not r.startswith("- decode tok/s")]
    rows.insert(5, "- decode tok/s = tokens made after every request's first token / those steps' wall time")
    for part in (lambda: check_stories(rows), lambda: _with_tmp(rows, args)):
        try:
            part()
        except Exception as error:
            traceback.print_exc()
            rows.append(f"| failed | | | {type(error).__name__}: {str(error)[:200]} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


def _with_tmp(rows: list[str], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        bench_1b(rows, Path(tmp), args)


if __name__ == "__main__":
    main()
