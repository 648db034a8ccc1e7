"""GPU reading of the paged, tiered engine: greedy CUDA == CPU, and decode tokens/s of the
Llama-3.2-1B shape (random bf16 weights) at batch 1, 16 and 64, tiers off and on, against Hugging
Face `generate` in the same run and the memory-bandwidth roofline. Writes one markdown table.

    python bench/decode_gpu.py --out $OUT/decode_gpu.md

Needs a CUDA GPU, torch and transformers; no network and no `gguf` package: stories260K is read
in HF format from $THERMOCLINE_SHARED_DIR/models/stories260K/hf (or ../shared). Each part runs on
its own: a failing check is written into the table and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_first_reading import (
    LLAMA_1B,
    STORIES_PROMPTS,
    _common_prefix,
    copy_bandwidth_gbs,
    greedy_ids,
    hf_decode,
    make_dummy_1b,
)

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine, SamplingParams
from services.engine.model.registry import resolve_model
from services.engine.serving.generation_result import ResultCollector

TIERS_ON = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=4096, group_size=32)
TIERS_ON_LABEL = "ours, tiers on (hot 128, INT4 g32)"


def check_cuda_equals_cpu(rows: list[str]) -> None:
    """stories260K fp32: CPU vs CUDA, tiers off and on (256 tokens, so the warm tier is used)."""
    path = resolve_model("stories260k")
    for label, kv, new_tokens in (
        ("tiers off", KVCacheSpec(), 64),
        ("tiers on, hot 128", KVCacheSpec(tiers=TIERS_ON), 256),
    ):
        outputs = {}
        for device in ("cpu", "cuda"):
            engine = LLMEngine.load(
                path, device=device, dtype="float32", max_batch_size=4, progress=False, kv=kv
            )
            outputs[device] = greedy_ids(engine, STORIES_PROMPTS, new_tokens)
        same = outputs["cpu"] == outputs["cuda"]
        agree = [_common_prefix(a, b) for a, b in zip(outputs["cpu"], outputs["cuda"], strict=True)]
        rows.append(
            f"| stories260K fp32, batch {len(STORIES_PROMPTS)}, {new_tokens} greedy tokens, {label} "
            f"| CPU vs CUDA | {'identical' if same else 'differs'} | tokens agreeing per prompt: {agree} |"
        )


def our_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s over the batch, median TTFT ms) for our engine, timed over decode steps only.

    The prompts are submitted together and stepped by hand: once every request has its first
    token, each further step is a pure decode step of the whole batch, and only those are timed
    (every step ends in the host read of the sampled ids, so the wall clock covers the GPU work).
    """
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, LLAMA_1B["vocab_size"], (batch, prompt_len), generator=generator).tolist()
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        engine.submit(prompt, params, collector)
    first = engine.stats().num_generated_tokens_total
    while engine.stats().num_generated_tokens_total < first + batch:  # prefill, first tokens
        engine.step()
    torch.cuda.synchronize()
    start_tokens, started = engine.stats().num_generated_tokens_total, time.perf_counter()
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    elapsed_s = time.perf_counter() - started
    ttfts = sorted(c.result().ttft_ms for c in collectors)
    return (engine.stats().num_generated_tokens_total - start_tokens) / elapsed_s, ttfts[len(ttfts) // 2]


def kv_bytes_per_token(tiers: TierConfig | None) -> float:
    """bf16 hot bytes per token of the 1B shape, or the INT4 warm bytes when `tiers` is given."""
    layers, heads, dim = LLAMA_1B["num_hidden_layers"], LLAMA_1B["num_key_value_heads"], 64
    if tiers is None:
        return layers * 2 * heads * dim * 2
    group = tiers.group_size
    per_head = (
        2 * dim / 2 + 2 * 2 * dim / group + 2 * 2 * (dim // min(group, dim))
    )  # codes, key s/z, value s/z
    return layers * heads * per_head


def roofline_tokens_s(
    params: int, batch: int, context: int, bandwidth_gbs: float, tiers: TierConfig | None
) -> float:
    """Decode tokens/s if each step read the bf16 weights and the batch's KV (hot + warm) once."""
    hot = context if tiers is None else min(context, tiers.sink_tokens + tiers.hot_tokens + tiers.group_size)
    warm = context - hot
    kv = hot * kv_bytes_per_token(None) + warm * kv_bytes_per_token(tiers if tiers else None)
    return batch / ((params * 2 + batch * kv) / (bandwidth_gbs * 1e9))


def bench_decode(rows: list[str], workdir: Path, args: argparse.Namespace) -> None:
    """Decode throughput of the 1B shape: ours (tiers off / on) vs transformers vs the roofline."""
    from transformers import LlamaForCausalLM

    path = workdir / "llama-3.2-1b-shape"
    params = make_dummy_1b(path)
    bandwidth = copy_bandwidth_gbs()
    context = args.prompt_len + args.new_tokens // 2
    rows.append(
        f"\nmeasured copy bandwidth: {bandwidth:.0f} GB/s; parameters: {params / 1e9:.3f} B; "
        f"mean context {context}\n"
    )
    rows.append("| batch | engine | decode tok/s | vs HF | roofline tok/s | vs roofline | median TTFT ms |")
    rows.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    max_seq_len = args.prompt_len + args.new_tokens + 8
    hf_model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    configs = (("ours, tiers off", KVCacheSpec()), (TIERS_ON_LABEL, KVCacheSpec(tiers=TIERS_ON)))
    engines = {
        label: LLMEngine.load(
            path,
            device="cuda",
            dtype="bfloat16",
            max_batch_size=max(args.batches),
            max_seq_len=max_seq_len,
            progress=False,
            kv=kv,
        )
        for label, kv in configs
    }
    runs: dict[tuple[str, int], list[tuple[float, float] | str]] = {}
    for _ in range(args.repeats):  # interleaved, so a drift in the host's speed hits every engine alike
        for b in args.batches:
            runs.setdefault(("HF generate", b), []).append(_guarded(_hf_run(hf_model, b, args)))
            for label, engine in engines.items():
                runs.setdefault((label, b), []).append(
                    _guarded(lambda b=b, e=engine: our_decode(e, b, args.prompt_len, args.new_tokens))
                )
    for b in args.batches:
        hf_result = _median(runs[("HF generate", b)])
        for label in ("HF generate", "ours, tiers off", TIERS_ON_LABEL):
            tiers = TIERS_ON if label == TIERS_ON_LABEL else None
            roof = roofline_tokens_s(params, b, context, bandwidth, tiers)
            rows.append(_row(b, label, _median(runs[(label, b)]), hf_result, roof))


def _median(results: list[tuple[float, float] | str]) -> tuple[float, float] | str:
    """The run with the median tokens/s (a failure, if any run failed)."""
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        return failed[0]
    ranked = sorted(results, key=lambda r: r[0])  # type: ignore[index]
    return ranked[len(ranked) // 2]


def _row(
    batch: int, label: str, result: tuple[float, float] | str, hf: tuple[float, float] | str, roof: float
) -> str:
    if isinstance(result, str):
        return f"| {batch} | {label} | failed: {result} | | {roof:.0f} | | |"
    vs_hf = f"{result[0] / hf[0]:.2f}" if not isinstance(hf, str) else "n/a"
    share = f"{result[0] / roof:.1%}"
    return f"| {batch} | {label} | {result[0]:.0f} | {vs_hf} | {roof:.0f} | {share} | {result[1]:.1f} |"


def _hf_run(
    model: torch.nn.Module, batch: int, args: argparse.Namespace
) -> Callable[[], tuple[float, float]]:
    return lambda: hf_decode(model, batch, args.prompt_len, args.new_tokens)


def _guarded(run: Callable[[], tuple[float, float]]) -> tuple[float, float] | str:
    """Run one measurement; an exception becomes the table's text instead of ending the run."""
    try:
        return run()
    except Exception as error:  # the reading should still report everything else
        traceback.print_exc()
        return f"{type(error).__name__}: {str(error)[:160]}"


def header(args: argparse.Namespace) -> list[str]:
    """Date, commit, hardware and settings."""
    props = torch.cuda.get_device_properties(0)
    commit = (
        os.environ.get("THERMOCLINE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown"
    )
    return [
        "# GPU reading: paged, tiered engine",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {commit}",
        f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}",
        f"- settings: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (EOS ignored), batches "
        f"{args.batches}, {args.repeats} interleaved repeats, bf16 weights and hot KV, greedy, "
        "random weights in the Llama-3.2-1B shape; "
        "attention is the plain PyTorch reference path (paged gather + INT4 dequantize), no fused kernel yet",
        "- decode tok/s (ours) = tokens generated after every request's first token / the wall time of "
        "those pure decode steps, stepped by hand; median of --repeats runs interleaved across engines; "
        "HF by differencing "
        "1 and N new tokens; roofline = batch x copy bandwidth / (bf16 weights + the batch's KV bytes "
        "at the mean context)",
        "",
        "| check | compared | result | detail |",
        "| --- | --- | --- | --- |",
    ]


def main() -> None:
    """Runs the checks and the benchmark; prints the table and writes it to --out."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs per engine; the median is kept"
    )
    parser.add_argument("--checks-only", action="store_true", help="skip the decode benchmark")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = header(args)
    try:
        check_cuda_equals_cpu(rows)
    except Exception as error:
        traceback.print_exc()
        rows.append(f"| CUDA vs CPU | | failed | {type(error).__name__}: {str(error)[:200]} |")
    if not args.checks_only:
        with tempfile.TemporaryDirectory() as tmp:
            bench_decode(rows, Path(tmp), args)
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
