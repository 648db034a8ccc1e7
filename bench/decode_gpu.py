# ruff: noqa: E501  (markdown table rows and their f-strings read better unwrapped)
"""GPU benchmark of the fast path: decode tok/s, TTFT, share of the bandwidth roofline and peak memory
of the Llama-3.2-1B and Llama-3.1-8B shapes (random bf16 weights, EOS ignored, greedy), tiers off and
on, against Hugging Face `generate` in the same run; greedy CUDA (Triton + CUDA graphs) == CPU
(reference) on stories260K; and the capacity line at 32K context. Writes one markdown file.

    python bench/decode_gpu.py --out $OUT/decode_gpu.md            # everything (about 8 minutes)
    python bench/decode_gpu.py --parts long --out long.md          # only the 8B 32K-context part

Needs a CUDA GPU, torch and transformers; no network. Each part runs on its own: a failure is
written into the table and the run goes on. On a machine without the mesh's own packages (the lent
GPU machine), carry them from here: `tools/carry_wheels.sh` fills `.whl` and prints how to install it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention_kernel
from gpu_first_reading import (
    LLAMA_1B,
    STORIES_PROMPTS,
    _common_prefix,
    copy_bandwidth_gbs,
    greedy_ids,
)

from services.engine.attention import triton_backend
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine, SamplingParams
from services.engine.model.checkpoint import Checkpoint
from services.engine.model.config import ModelConfig
from services.engine.model.registry import resolve_model
from services.engine.serving.generation_result import ResultCollector
from services.engine.text.tokenizer import Tokenizer

LLAMA_8B = {
    **LLAMA_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "rope_parameters": {**LLAMA_1B["rope_parameters"], "factor": 8.0},
}
SHAPES = {"1B": LLAMA_1B, "8B": LLAMA_8B}
TIERS_ON = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=40_000, group_size=32)
OFF, ON = "ours, tiers off", "ours, tiers on (hot 128, INT4 g32)"


def random_checkpoint(shape: dict, tokenizer_dir: Path, device: str = "cuda") -> Checkpoint:
    """A checkpoint whose weights are drawn on `device` as they are loaded (no file of 16 GB)."""
    config = ModelConfig.from_hf_config(shape)
    e, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    names = {"embed_tokens.weight": (config.vocab_size, e), "norm.weight": (e,)}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = (config.vocab_size, e)
    for layer in range(config.num_layers):
        for name, size in {
            "input_layernorm": (e,), "post_attention_layernorm": (e,), "self_attn.q_proj": (q, e),
            "self_attn.k_proj": (kv, e), "self_attn.v_proj": (kv, e), "self_attn.o_proj": (e, q),
            "mlp.gate_proj": (i, e), "mlp.up_proj": (i, e), "mlp.down_proj": (e, i),
        }.items():  # fmt: skip
            names[f"layers.{layer}.{name}.weight"] = size

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=device).manual_seed(0)
        for name, size in names.items():
            scale = 1.0 if len(size) == 1 else 0.02
            yield name, torch.randn(size, device=device, generator=generator, dtype=torch.bfloat16) * scale

    return Checkpoint("random", config, Tokenizer.from_hf_dir(tokenizer_dir), tensors, len(names))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the ids (the benchmark submits ids; detokenizing must not fail)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))


def params_count(shape: dict) -> int:
    config = ModelConfig.from_hf_config(shape)
    e, i = config.hidden_size, config.intermediate_size
    per_layer = e * (config.q_size * 2 + config.kv_size * 2) + 3 * e * i + 2 * e
    embed = config.vocab_size * e * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + embed + e


def kv_bytes_per_token(shape: dict, tiers: TierConfig | None) -> float:
    """bf16 hot bytes per token, or the INT4 warm bytes when `tiers` is given (codes + scales + zeros)."""
    config = ModelConfig.from_hf_config(shape)
    layers, heads, dim = config.num_layers, config.num_kv_heads, config.head_dim
    if tiers is None:
        return layers * 2 * heads * dim * 2
    group = tiers.group_size
    per_head = 2 * dim / 2 + 2 * 2 * dim / group + 2 * 2 * (dim // min(group, dim))
    return layers * heads * per_head


def roofline(shape: dict, batch: int, context: int, bandwidth_gbs: float, tiers: TierConfig | None) -> float:
    """Decode tok/s if a step read the bf16 weights and the batch's KV (each tier's bytes) once."""
    hot = context if tiers is None else min(context, tiers.sink_tokens + tiers.hot_tokens + tiers.group_size)
    kv = hot * kv_bytes_per_token(shape, None) + (context - hot) * kv_bytes_per_token(shape, tiers)
    return batch / ((params_count(shape) * 2 + batch * kv) / (bandwidth_gbs * 1e9))


# Every run draws prompts no run drew before: an engine keeps the full prompt blocks of finished
# requests for prefix reuse, so a repeat of the same prompts would time a prefix hit as TTFT (the
# tiers-off engine did until 2026-12-03: 26 ms for sixteen 1K prompts at 8B).
_PROMPT_SEEDS = itertools.count(1)


class GcPauses:
    """Python's cyclic garbage collections while it is entered: how many per generation, and their
    total pause. A full (generation 2) collection walks every tracked object of the process, which
    in a benchmark that holds two engines, an HF model and every earlier run's requests is many."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._started) * 1e3

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return "gc " + ", ".join(
            f"gen{g} {n}x {ms:.1f} ms" for g, (n, ms) in enumerate(zip(self.count, self.ms, strict=True))
        )


def our_decode(engine: LLMEngine, vocab: int, batch: int, prompt_len: int, new_tokens: int) -> tuple:
    """(decode tok/s, median TTFT ms, peak GiB): decode timed over pure decode steps, stepped by hand."""
    generator = torch.Generator().manual_seed(next(_PROMPT_SEEDS))
    # prompts of the timed length (up to a 4K prefill chunk): the first prefill at a new length
    # compiles kernels (1-2.5 s at 8B), which must not land in a timed run's TTFT. A longer prompt
    # is prefilled in chunks over its cached (with the tiers on, warm) prefix, which launches other
    # kernel variants: one warm-up prompt goes two chunks and a short tail past the first.
    warm_up = torch.randint(2, vocab, (2, min(prompt_len, 4096)), generator=generator).tolist()
    if prompt_len > 4096:
        warm_up.append(
            torch.randint(2, vocab, (min(prompt_len, 2 * 4096 + 300),), generator=generator).tolist()
        )
    prompts = torch.randint(2, vocab, (batch, prompt_len), generator=generator).tolist()
    engine.generate(warm_up, SamplingParams(max_new_tokens=4, ignore_eos=True))
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        engine.submit(prompt, params, collector)
    stats_before = engine.stats()
    prefill_ms = []
    # prefill: until every request has its first token (counting tokens would stop early with mixed
    # steps, whose decode rows make tokens while later prompts are still being computed)
    while not all(c.has_first_token for c in collectors):
        before = time.perf_counter()
        engine.step()
        prefill_ms.append((time.perf_counter() - before) * 1e3)
    torch.cuda.synchronize()
    start_tokens, started = engine.stats().num_generated_tokens_total, time.perf_counter()
    step_ms = []
    with GcPauses() as pauses:
        while not all(c.done.is_set() for c in collectors):
            before = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - before) * 1e3)
    elapsed_s = time.perf_counter() - started
    cached = engine.stats().num_prompt_tokens_cached - stats_before.num_prompt_tokens_cached
    print(
        f"batch {batch}, prompt {prompt_len} ({cached} prompt tokens cached): prefill steps (ms) "
        + " ".join(f"{ms:.1f}" for ms in prefill_ms[:8])
        + f"; decode {step_summary(step_ms)}; {pauses}; allocator retries "
        + str(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
        flush=True,
    )
    ttft = statistics.median(c.result().ttft_ms for c in collectors)
    tokens = engine.stats().num_generated_tokens_total - start_tokens
    return tokens / elapsed_s, ttft, torch.cuda.max_memory_allocated() / 2**30


def step_summary(step_ms: list[float]) -> str:
    """The spread of one run's decode steps (host wall time of each `engine.step`), and its slowest."""
    ordered = sorted(step_ms)
    median = statistics.median(ordered)
    slowest = sorted(range(len(step_ms)), key=step_ms.__getitem__, reverse=True)[:5]
    return (
        f"{len(step_ms)} steps, p50 {median:.2f} ms, "
        f"p90 {ordered[int(0.9 * (len(ordered) - 1))]:.2f}, max {ordered[-1]:.2f}, "
        f"sum over p50 {sum(step_ms) - median * len(step_ms):.1f} ms; slowest (step: ms) "
        + ", ".join(f"{i}: {step_ms[i]:.1f}" for i in slowest)
    )


def hf_decode(model: torch.nn.Module, vocab: int, batch: int, prompt_len: int, new_tokens: int) -> tuple:
    """(decode tok/s, TTFT ms, peak GiB) for transformers `generate`, by differencing 1 and N tokens."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, vocab, (batch, prompt_len), generator=generator).cuda()

    def run(n: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run(2)
    torch.cuda.reset_peak_memory_stats()
    first_s, total_s = run(1), run(new_tokens)
    return (
        batch * (new_tokens - 1) / (total_s - first_s),
        first_s * 1e3,
        torch.cuda.max_memory_allocated() / 2**30,
    )


def guarded(run: Callable[[], tuple]) -> tuple | str:
    try:
        return run()
    except Exception as error:
        traceback.print_exc()
        return f"{type(error).__name__}: {str(error)[:160]}"


def median_run(results: list) -> tuple | str:
    """The run of median throughput, with the median TTFT of all runs (not that run's own)."""
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        return failed[0]
    middle = sorted(results, key=lambda r: r[0])[len(results) // 2]
    return (middle[0], statistics.median(r[1] for r in results), *middle[2:])


def table_row(shape: str, context: int, batch: int, label: str, result, hf, roof: float) -> str:
    if isinstance(result, str):
        return f"| {shape} | {context} | {batch} | {label} | failed: {result} | | | | | |"
    vs_hf = f"{result[0] / hf[0]:.2f}" if hf is not None and not isinstance(hf, str) else ""
    return (
        f"| {shape} | {context} | {batch} | {label} | {result[0]:.0f} | {vs_hf} | {roof:.0f} | "
        f"{result[0] / roof:.0%} | {result[1]:.0f} | {result[2]:.1f} |"
    )


MIXED_STEPS = True  # decode rows beside prompt chunks (the engine default); --mixed-steps off: prompts first


def load(checkpoint: Checkpoint, tokdir: Path, batch: int, seq_len: int, kv: KVCacheSpec, prefill: int):
    return LLMEngine.load(tokdir, device="cuda", dtype="bfloat16", max_batch_size=batch, max_seq_len=seq_len,
                          progress=False, kv=kv, checkpoint=checkpoint, max_prefill_tokens=prefill,
                          mixed_steps=MIXED_STEPS)  # fmt: skip


def bench_short(rows: list[str], notes: list[str], tokdir: Path, args, bandwidth: float,
                flush: Callable[[], None]) -> None:  # fmt: skip
    """1,024-token prompts: 1B and 8B, tiers off and on, against HF, interleaved, median of repeats."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        batches = args.batches
        seq_len = args.prompt_len + args.new_tokens + 16
        checkpoint = random_checkpoint(shape, tokdir)
        # Two engines share the GPU, so that their runs interleave: each takes its share of memory (the
        # second's budget counts the first). Tiers off gets the larger share: at 8B, 256 rows of ~1.1K
        # tokens are 38 GiB of BF16 KV, which a 0.3 share (42 GiB with the weights) could not hold, and
        # a capacity-starved engine queues rows instead of decoding them (the first 8B readings did).
        # Tiers on stops at 0.75 (about 330 rows of 1.1K at 8B), leaving room for the HF model.
        engines = {
            OFF: load(
                checkpoint, tokdir, max(batches), seq_len, KVCacheSpec(gpu_memory_utilization=0.5), 8192
            ),
            ON: load(
                checkpoint,
                tokdir,
                max(batches),
                seq_len,
                KVCacheSpec(tiers=TIERS_ON, gpu_memory_utilization=0.75),
                8192,
            ),
        }
        for label, engine in engines.items():
            notes.append(f"- capacity, {shape_name}, {label}: {engine.capacity.describe()}")
        hf_model = None
        if any(b <= args.hf_max_batch for b in batches):  # building the HF model takes seconds
            # built in bf16 directly: an fp32 8B model (32 GB) does not fit beside the two engines
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device("cuda"):
                    hf_model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
            finally:
                torch.set_default_dtype(default_dtype)
        # as the engine service does once it has loaded (services/engine/__main__.py)
        if args.gc_freeze == "on":
            gc.collect()
            gc.freeze()
        runs: dict = {}
        for _ in range(args.repeats):
            for b in batches:
                if b <= args.hf_max_batch:
                    runs.setdefault(("HF", b), []).append(
                        guarded(
                            lambda b=b, m=hf_model, v=shape["vocab_size"]: hf_decode(
                                m, v, b, args.prompt_len, args.new_tokens
                            )
                        )
                    )
                for label, engine in engines.items():
                    runs.setdefault((label, b), []).append(
                        guarded(
                            lambda b=b, e=engine, v=shape["vocab_size"]: our_decode(
                                e, v, b, args.prompt_len, args.new_tokens
                            )
                        )
                    )
        context = args.prompt_len + args.new_tokens // 2
        for b in batches:
            hf = median_run(runs[("HF", b)]) if ("HF", b) in runs else None
            if hf is not None:
                rows.append(
                    table_row(
                        shape_name,
                        args.prompt_len,
                        b,
                        "HF generate",
                        hf,
                        hf,
                        roofline(shape, b, context, bandwidth, None),
                    )
                )
            for label in (OFF, ON):
                tiers = TIERS_ON if label == ON else None
                fits = engines[label].capacity.concurrent_sequences
                shown = label if fits >= b else f"{label}, capacity-starved: {fits} rows fit"
                rows.append(table_row(shape_name, args.prompt_len, b, shown, median_run(runs[(label, b)]), hf,
                                      roofline(shape, b, context, bandwidth, tiers)))  # fmt: skip
        flush()  # a shape's table survives a later timeout
        if args.profile:
            for label, engine in engines.items():
                label_text = f"{shape_name}, {label}"
                notes.append(
                    profile_decode(
                        engine, shape, max(batches), args.prompt_len, label_text, args.profile_skip
                    )
                )
                flush()
        for engine in engines.values():
            engine.stop()
        del engines, engine, hf_model, checkpoint  # `engine` too: the loop name keeps the last one alive
        gc.unfreeze()  # the next shape's engines need this one's memory back
        gc.collect()
        torch.cuda.empty_cache()


def bench_long(rows: list[str], notes: list[str], tokdir: Path, args, bandwidth: float, decode: bool,
               flush: Callable[[], None]) -> None:  # fmt: skip
    """8B at a 32,768-token prompt, tiers on then off, one engine at a time, each sized from GPU memory at
    utilization 0.90: the capacity line is the pools each engine planned; `decode` adds the timed runs."""
    shape = LLAMA_8B
    prompt = args.long_prompt
    seq_len = prompt + args.new_tokens + 16
    batches = args.long_batches if decode else []
    checkpoint = random_checkpoint(shape, tokdir)
    util = args.long_utilization
    engines = (
        (ON, KVCacheSpec(tiers=TIERS_ON, gpu_memory_utilization=util)),
        (OFF, KVCacheSpec(gpu_memory_utilization=util)),
    )
    for label, kv in [
        (label, kv) for label, kv in engines if ("on" if label == ON else "off") in args.long_tiers
    ]:
        engine = guarded(lambda kv=kv: (load(checkpoint, tokdir, max(args.long_batches), seq_len, kv,
                                              args.long_prefill),))  # fmt: skip
        if isinstance(engine, str):
            rows.append(f"| 8B | {prompt} | | {label} | failed: {engine} | | | | | |")
            continue
        engine = engine[0]
        free, total = torch.cuda.mem_get_info()
        plan = engine.capacity
        notes.append(
            f"- capacity, {label}, max_seq_len {seq_len:,}: {plan.describe()}. Device memory in use after "
            f"load and graph capture: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB "
            f"({(total - free) / total:.1%}; the setting is {kv.gpu_memory_utilization:.0%})."
        )
        flush()
        tiers = TIERS_ON if label == ON else None
        for b in batches:
            result = guarded(
                lambda b=b, e=engine: our_decode(e, shape["vocab_size"], b, prompt, args.new_tokens)
            )
            rows.append(table_row("8B", prompt, b, label, result, None,
                                  roofline(shape, b, prompt + args.new_tokens // 2, bandwidth, tiers)))  # fmt: skip
            flush()
        if label == ON and args.profile and decode:
            notes.append(profile_decode(engine, shape, max(batches), prompt, f"8B, {label}"))
            flush()
        engine.stop()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def profile_decode(engine: LLMEngine, shape: dict, batch: int, prompt: int, label: str, skip: int = 4) -> str:
    """torch.profiler over 8 decode steps of a running batch, after `skip` of them: where a step's GPU
    time goes (a `skip` of 12 puts the first demotion after the prompt's, step 15, among the eight).

    Device activity only: recording host ops too made the profile of 8 batch-256 steps run past a
    300 s command limit on the H200. The plain wall time per step beside the device's kernel time
    per step says how much of a step the device waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    prompts = torch.randint(2, shape["vocab_size"], (batch, prompt)).tolist()
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    collectors = [ResultCollector(p) for p in prompts]
    for p, c in zip(prompts, collectors, strict=True):
        engine.submit(p, params, c)
    while engine.stats().num_running < batch or engine.stats().num_waiting:
        engine.step()
    for _ in range(skip):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - started) * 1000 / 8
    for _ in range(24):  # back to the same place in the demotion cycle (every 32 tokens)
        engine.step()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1000 / 8
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    averages = prof.key_averages()
    device_ms = sum(e.self_device_time_total for e in averages) / 1000 / 8
    device_table = averages.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60)
    return (f"\n### Profile: {label}, {prompt}-token context, batch {batch}, 8 decode steps\n\n"
            f"Per step: {plain_ms:.1f} ms of wall time ({wall_ms:.1f} under the profiler), {device_ms:.1f} ms of device "
            f"kernel time.\n\n```\n{device_table}\n```\n")  # fmt: skip


def check_cuda_equals_cpu(rows: list[str]) -> None:
    """stories260K fp32: greedy on CUDA (Triton, graphs on and off) equals the CPU reference."""
    path = resolve_model("stories260K")
    for label, kv, new_tokens in (
        ("tiers off", KVCacheSpec(), 64),
        (
            "tiers on, hot 128",
            KVCacheSpec(tiers=TierConfig(enabled=True, hot_tokens=128, warm_tokens=4096)),
            200,
        ),
    ):
        outputs = {}
        for name, device, graphs in (
            ("cpu", "cpu", False),
            ("cuda eager", "cuda", False),
            ("cuda graphs", "cuda", True),
        ):
            engine = LLMEngine.load(path, device=device, dtype="float32", max_batch_size=4, progress=False,
                                    kv=kv, cuda_graphs=graphs)  # fmt: skip
            outputs[name] = greedy_ids(engine, STORIES_PROMPTS, new_tokens)
            engine.stop()
            # the next engine sizes its pools from the memory left: this one's must be gone first
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        for name in ("cuda eager", "cuda graphs"):
            agree = [_common_prefix(a, b) for a, b in zip(outputs["cpu"], outputs[name], strict=True)]
            same = outputs["cpu"] == outputs[name]
            rows.append(f"| stories260K fp32, batch 4, {new_tokens} greedy tokens, {label} | CPU reference vs {name} "
                        f"(Triton) | {'identical' if same else 'differs'} | tokens agreeing: {agree} |")  # fmt: skip


def run_commit() -> str:
    """The commit a GPU run reports: THERMOCLINE_COMMIT where set (the device machine's checkout may
    name another), else this checkout's HEAD."""
    return (
        os.environ.get("THERMOCLINE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown"
    )


def header(args) -> list[str]:
    props = torch.cuda.get_device_properties(0)
    commit = run_commit()
    return [
        "# GPU fast path: fused Triton attention, CUDA-graph decode",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {commit}",
        f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}",
        f"- settings: {vars(args)}",
        f"- tiers on: {TIERS_ON}",
        f"- prefill launch: in place {triton_backend.PREFILL_LAUNCH or 'the kernel default'}, warm prefix as "
        f"pages {triton_backend.PREFIX_PAGES_LAUNCH or 'the kernel default'}",
        f"- dense prefill (dense_prefill.py, cuDNN and FlashAttention): {args.dense_prefill}, for steps with a row "
        f"of at least {triton_backend.DENSE_PREFILL_MIN_QUERY_TOKENS} new tokens (where the library kernels pass their startup check)",
        "- decode tok/s (ours) = tokens generated after every request's first token / wall time of those "
        "pure decode steps; HF by differencing 1 and N new tokens; roofline = batch x measured copy bandwidth / "
        "(bf16 weights + the batch's KV bytes per tier at the mean context); peak = torch max allocated",
        "",
        "| check | compared | result | detail |",
        "| --- | --- | --- | --- |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="checks,short,long,capacity")
    parser.add_argument("--shapes", default="1B,8B", type=lambda s: s.split(","))
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--hf-max-batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--gc-freeze", choices=("on", "off"), default="on",
        help="freeze the garbage collector's view of the loaded engines before timing, as the engine service does",
    )  # fmt: skip
    parser.add_argument("--long-prompt", type=int, default=32_768)
    parser.add_argument("--long-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    parser.add_argument(
        "--long-prefill", type=int, default=4096, help="max prefill tokens per step (the engine default)"
    )
    parser.add_argument(
        "--long-utilization", type=float, default=0.90, help="the 32K engines' GPU memory utilization"
    )
    parser.add_argument(
        "--long-tiers",
        default="on,off",
        type=lambda s: s.split(","),
        help="which 32K engines to load: on, off or both (each takes minutes)",
    )
    parser.add_argument(
        "--prefill-launch", default=None,
        help="every prefill step's launch overrides (in place and over pages), in bench/attention_kernel.py's "
        "TILExWARPSx... form (default: the engine's)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-prefill", choices=("on", "off"), default="on",
        help="prefill through the dense library-attention path where it runs (dense_prefill.py), or always "
        "through the paged kernel",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-steps", choices=("on", "off"), default="on",
        help="running streams decode beside prompt chunks (the engine default), or prompts first",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-skip", type=int, default=4, help="decode steps before the 8 profiled")
    args = parser.parse_args()
    triton_backend.DENSE_PREFILL = args.dense_prefill == "on"
    global MIXED_STEPS
    MIXED_STEPS = args.mixed_steps == "on"
    if args.prefill_launch:
        for launch in (triton_backend.PREFILL_LAUNCH, triton_backend.PREFIX_PAGES_LAUNCH):
            launch.clear()
            launch.update(attention_kernel.launch_overrides(args.prefill_launch))
    torch.backends.cuda.matmul.allow_tf32 = False
    parts = args.parts.split(",")
    rows, notes = header(args), []
    text = lambda: "\n".join(rows + notes) + "\n"  # noqa: E731
    if "checks" in parts:
        try:
            check_cuda_equals_cpu(rows)
        except Exception as error:
            traceback.print_exc()
            rows.append(f"| CUDA vs CPU | | failed | {type(error).__name__}: {str(error)[:200]} |")
    if args.out is not None:
        args.out.write_text(text())
    bandwidth = copy_bandwidth_gbs()
    rows += ["", f"measured copy bandwidth: {bandwidth:.0f} GB/s", "",
             "| shape | prompt | batch | engine | decode tok/s | vs HF | roofline tok/s | of roofline | median TTFT ms | peak GiB |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tokdir = Path(tmp) / "tokenizer"
        write_tokenizer(tokdir, LLAMA_1B["vocab_size"])
        flush = lambda: args.out.write_text(text()) if args.out is not None else None  # noqa: E731
        runs = {"short": lambda: bench_short(rows, notes, tokdir, args, bandwidth, flush),
                "long": lambda: bench_long(rows, notes, tokdir, args, bandwidth, True, flush),
                "capacity": lambda: bench_long(rows, notes, tokdir, args, bandwidth, False, flush)}  # fmt: skip
        if "long" in parts and "capacity" in parts:
            parts.remove("capacity")  # the long part reports the capacity of the engines it loads
        for run in (runs[p] for p in parts if p in runs):
            guarded(lambda run=run: (run(),))
            if args.out is not None:
                args.out.write_text(text())  # partial results survive a later timeout
    print(text())
    if args.out is not None:
        args.out.write_text(text())


if __name__ == "__main__":
    main()
