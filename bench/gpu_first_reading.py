"""First GPU reading: does the engine give the same greedy tokens on CUDA as on the CPU, and how fast
does it decode the Llama-3.2-1B shape (random weights) against Hugging Face `generate` and the
memory-bandwidth roofline? One run, one table; results are written to --out as markdown.

    python bench/gpu_first_reading.py --out $OUT/gpu_first_reading.md

Needs a CUDA GPU, transformers, and stories260K (THERMOCLINE_SHARED_DIR or ../shared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.engine.llm_engine import LLMEngine, SamplingParams
from services.engine.model.registry import resolve_model

STORIES_PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben went to the park to play", "One day"]

# Llama-3.2-1B's published shape (config.json of meta-llama/Llama-3.2-1B).
LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens two completions share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def greedy_ids(engine: LLMEngine, prompts: list[str], max_new_tokens: int) -> list[tuple[int, ...]]:
    """Greedy completions of `prompts`, decoded as one batch."""
    ids = [engine.tokenizer.encode(p) for p in prompts]
    return [r.token_ids for r in engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens))]


def check_stories(rows: list[str]) -> None:
    """stories260K: CPU fp32 vs CUDA fp32 (must be equal) and CUDA bf16 (agreement reported)."""
    path = resolve_model("stories260k")
    cpu = greedy_ids(LLMEngine.load(path, device="cpu", dtype="float32", progress=False), STORIES_PROMPTS, 64)
    for dtype in ("float32", "bfloat16"):
        cuda = greedy_ids(
            LLMEngine.load(path, device="cuda", dtype=dtype, progress=False), STORIES_PROMPTS, 64
        )
        agree = [_common_prefix(a, b) for a, b in zip(cpu, cuda, strict=True)]
        rows.append(
            f"| stories260K, batch of {len(cpu)}, 64 greedy tokens | CPU fp32 vs CUDA {dtype} "
            f"| {'identical' if cpu == cuda else 'differs'} | tokens agreeing per prompt: {agree} |"
        )


def check_tiny_against_hf(rows: list[str], workdir: Path) -> None:
    """A tiny random Llama (GQA, llama3 RoPE): ours on CUDA fp32 vs transformers on CUDA fp32."""
    from transformers import LlamaForCausalLM

    from tests.engine.tiny_llama import TinySpec, make_tiny_llama

    path = make_tiny_llama(workdir / "tiny", TinySpec())
    ours = LLMEngine.load(path, device="cuda", dtype="float32", progress=False)
    prompts = ["Once upon a time", "The quick brown fox jumps", "Thermocline"]
    our_ids = greedy_ids(ours, prompts, 32)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf_ids = []
    for prompt in prompts:
        ids = torch.tensor([ours.tokenizer.encode(prompt)], device="cuda")
        # an explicit mask: without one, generate masks every id equal to pad_token_id (here BOS)
        mask = torch.ones_like(ids)
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        hf_ids.append(tuple(out[0, ids.shape[1] :].tolist()))
    same = all(a == b[: len(a)] for a, b in zip(our_ids, hf_ids, strict=True))
    agree = [_common_prefix(a, b) for a, b in zip(our_ids, hf_ids, strict=True)]
    rows.append(
        f"| tiny random Llama, 3 prompts, 32 greedy tokens | ours CUDA fp32 vs transformers CUDA fp32 "
        f"| {'identical' if same else 'differs'} | tokens agreeing: {agree}; ours {our_ids}; HF {hf_ids} |"
    )


def make_dummy_1b(path: Path) -> int:
    """Writes a Llama-3.2-1B-shaped checkpoint with random bf16 weights; returns its parameter count."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(LLAMA_1B["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return count


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), median of 20."""
    src = torch.randn(512 * 1024 * 1024 // 2, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times[5:]) / 1e9


def our_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s over the batch, median TTFT ms) for our engine."""
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, LLAMA_1B["vocab_size"], (batch, prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    ttft_s = max(r.ttft_ms for r in results) / 1e3
    return batch * (new_tokens - 1) / (wall_s - ttft_s), statistics.median(r.ttft_ms for r in results)


def hf_decode(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, TTFT ms) for transformers `generate`, by differencing 1 and N new tokens."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, LLAMA_1B["vocab_size"], (batch, prompt_len), generator=generator).cuda()
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run(4)  # warm-up
    first_s, total_s = run(1), run(new_tokens)
    return batch * (new_tokens - 1) / (total_s - first_s), first_s * 1e3


def roofline_tokens_s(params: int, batch: int, context: int, bandwidth_gbs: float) -> float:
    """Decode tokens/s if each step only had to read the bf16 weights and the batch's KV once."""
    kv_bytes_per_token = LLAMA_1B["num_hidden_layers"] * 2 * LLAMA_1B["num_key_value_heads"] * 64 * 2
    step_bytes = params * 2 + batch * context * kv_bytes_per_token
    return batch / (step_bytes / (bandwidth_gbs * 1e9))


def bench_decode(
    rows: list[str], workdir: Path, batches: list[int], prompt_len: int, new_tokens: int
) -> None:
    """Decode throughput of the 1B shape: ours vs transformers vs the roofline."""
    from transformers import LlamaForCausalLM

    path = workdir / "llama-3.2-1b-shape"
    params = make_dummy_1b(path)
    bandwidth = copy_bandwidth_gbs()
    rows.append(f"\nmeasured copy bandwidth: {bandwidth:.0f} GB/s; parameters: {params / 1e9:.3f} B\n")
    rows.append(
        "| batch | ours decode tok/s | HF generate tok/s | ours / HF | roofline tok/s | ours / roofline "
        "| ours TTFT ms | HF TTFT ms |"
    )
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    engine = LLMEngine.load(
        path,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=max(batches),
        max_seq_len=prompt_len + new_tokens + 8,
        progress=False,
    )
    ours = {b: our_decode(engine, b, prompt_len, new_tokens) for b in batches}
    del engine
    torch.cuda.empty_cache()
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    theirs = {b: hf_decode(hf, b, prompt_len, new_tokens) for b in batches}
    context = prompt_len + new_tokens // 2
    for b in batches:
        roof = roofline_tokens_s(params, b, context, bandwidth)
        rows.append(
            f"| {b} | {ours[b][0]:.0f} | {theirs[b][0]:.0f} | {ours[b][0] / theirs[b][0]:.2f} | {roof:.0f} "
            f"| {ours[b][0] / roof:.1%} | {ours[b][1]:.1f} | {theirs[b][1]:.1f} |"
        )


def header(args: argparse.Namespace) -> list[str]:
    """Date, commit, hardware and settings."""
    props = torch.cuda.get_device_properties(0)
    return [
        "# First GPU reading",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- commit: {os.environ.get('THERMOCLINE_COMMIT', 'unknown')}",
        f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}",
        f"- settings: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (EOS ignored), "
        f"batches {args.batches}, bf16 weights and KV, greedy, random weights in the Llama-3.2-1B shape",
        "- decode tok/s = batch x (new tokens - 1) / (wall time - time to first token)",
        "",
        "| check | compared | result | detail |",
        "| --- | --- | --- | --- |",
    ]


def main() -> None:
    """Runs the checks and the benchmark; prints the table and writes it to --out."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--checks-only", action="store_true", help="skip the decode benchmark")
    args = parser.parse_args()
    rows = header(args)
    with tempfile.TemporaryDirectory() as tmp:
        check_stories(rows)
        check_tiny_against_hf(rows, Path(tmp))
        if not args.checks_only:
            bench_decode(rows, Path(tmp), args.batches, args.prompt_len, args.new_tokens)
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
