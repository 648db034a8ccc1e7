"""The engine's cold tier: prefix reuse (TTFT, hit against recompute) and the auxiliary window's
prefetch (the share of cold-block loads that decode never waited for).

Starts a redis-server and a kvstore process (the test suite's helpers), then:
- **Prefix reuse.** `--repeats` prompts of `--prefix` tokens (random ids, distinct per repeat, so
  no prompt shares a block with another) through three engines, one at a time, each freed before
  the next loads (on CUDA the KV pools are sized from the memory left): one without a cold tier
  (recompute: the baseline), one with it (computes, looks up and misses, stores its prompt blocks
  in the background; the bench waits for them to be durable), and a third with it, as a new
  replica would be (nothing of these prompts in its GPU prefix cache: it looks up, loads the
  stored prefix and computes the last block). The kvstore runs on this host, so by default the hit
  reads the stored records from its segment files itself (LocateBlocks, then the engine's own
  preads and CRC checks; `--no-local-reads`: the GetBlocks stream, as a remote kvstore would
  serve it). Each engine first runs a short warm-up pair (a prompt, then it extended), so
  compilation is not timed; on CUDA also a full-length prompt (the first long load pins its host
  buffer; its TTFT is in the notes). TTFT is submit -> first token, on the engine's own thread;
  `--max-new` greedy tokens after it say whether the hit's output equals the recompute's
  (reported, not asserted: prompt blocks are stored as BF16, so an FP32 engine attends a rounded
  prefix, and a BF16 one computes the last block in another kernel shape).
- **Prefetch** (SmolLM2 only; `--skip-window` leaves it out). One long generation in retrieval
  mode `semantic` with the tiers on: warm overflow is demoted to the store, every
  `--score-every` decode steps the query scores the cold blocks, and the chosen ones are loaded
  on the loader thread. A load counts as hidden when it was mapped by the step after the one
  that chose it. Time per output token with the window on is set against the window off.

Shapes: `smollm2` (SmolLM2-135M from the registry, FP32 on the CPU; the default) and `8B` (random
BF16 weights in the Llama-3.1-8B shape, drawn on the device as bench/decode_gpu.py draws them; the
prefix defaults to 32,768 tokens). On the CPU:

    .venv/bin/python bench/cold_tier.py --out bench/results/cold_tier_cpu_<date>.md

On an H200 with no Redis installed (carry one with tools/carry_redis.sh):

    export THERMOCLINE_REDIS_SERVER=$PWD/.redis/redis-server
    python3 bench/cold_tier.py --shape 8B --device cuda --skip-window --out $OUT/cold_tier_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_gpu import LLAMA_8B, random_checkpoint, write_tokenizer
from bench.machine import cpu_name
from services.common.kvstore_api import KVStoreClient, Namespace
from services.common.service_auth import TOKEN_FILE_SETTING
from services.engine.kv.cold_tier import ColdTierConfig
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import DEFAULT_MAX_PREFILL_TOKENS, LLMEngine
from services.engine.model.checkpoint import Checkpoint
from services.engine.model.config import ModelConfig
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import GenerationResult, ResultCollector
from tests.kvstore.conftest import KVStoreProcess, RedisServer

T = TypeVar("T")
WARMUP_TOKENS = 256  # the warm-up prompt; then the same prompt and WARMUP_EXTRA_TOKENS more
WARMUP_EXTRA_TOKENS = 64
WARMUP_SEED = 1_000_001  # no repeat's seed (random.Random(-n) is random.Random(n): no negative seeds)
REQUEST_TIMEOUT_S = 900.0  # one request, however slow the store: a hung bench says so
# A 32K-token 8B prefix is 4 GiB of BF16 blocks in one get (and two puts): the engine's default
# transfer deadline (30 s) would turn a slow hit into a silent recompute.
TRANSFER_DEADLINE_MS = 600_000
TINY = {  # a random-weight shape that runs in seconds on a CPU: checks the 8B path's plumbing
    **LLAMA_8B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@dataclass(frozen=True)
class Shape:
    """A model to bench and its defaults: SmolLM2 from the registry, or random BF16 weights."""

    hf_config: dict | None  # None: the registered SmolLM2-135M checkpoint
    prefix_tokens: int
    dtype: str
    max_prefill_tokens: int


SHAPES = {
    "smollm2": Shape(None, 8192 - 16, "float32", DEFAULT_MAX_PREFILL_TOKENS),
    # 16K-token prefill chunks, as bench/decode_gpu.py's 32K part: two chunks per prompt
    "8B": Shape(LLAMA_8B, 32_768, "bfloat16", 16_384),
    "tiny": Shape(TINY, 1024, "bfloat16", 512),
}


class ModelSource(NamedTuple):
    """What `LLMEngine.load` takes: a model path, and the random weights when the shape has them."""

    path: Path
    checkpoint: Checkpoint | None
    description: str


class Reading(NamedTuple):
    """Counters read before and after a request, on the engine and on the kvstore."""

    tokens_loaded: int
    prefill_tokens_computed: int
    degradations: int
    store_used_bytes: int
    blocks_served: int  # by the kvstore's GetBlocks stream, from its RAM staging or from disk
    blocks_read_locally: int  # by the engine from the segment files (same-host reads)


@dataclass(frozen=True)
class Request:
    """One timed request on one engine, and what it moved."""

    ttft_ms: float
    token_ids: tuple[int, ...]
    tokens_loaded: int
    prefill_tokens_computed: int
    degradations: int
    bytes_stored: int  # growth of the kvstore's live bytes (records with headers), after a flush
    blocks_served: int
    blocks_read_locally: int


@dataclass(frozen=True)
class PrefixRun:
    """One repeat of the prefix-reuse comparison: one prompt on each of the three engines."""

    recompute: Request
    miss: Request
    hit: Request
    kv_bytes_per_token: int  # BF16 keys and values of all layers: a stored prompt block's payload

    @property
    def bytes_loaded(self) -> int:
        """Payload the hit read back from the store."""
        return self.hit.tokens_loaded * self.kv_bytes_per_token


@dataclass(frozen=True)
class WindowRun:
    """The auxiliary-window generation, and the same request with the window off."""

    window_loads: int
    hidden_loads: int
    blocks_demoted: int
    tpot_window_ms: float
    tpot_off_ms: float
    degradations: int
    blocks_prefetched: int  # runner-ups the engine asked the store to stage (Prefetch)
    served_from_ram: int  # the store's GetBlocks answers from RAM staging during the window-on run
    served_from_disk: int


# --- engines --------------------------------------------------------------------------------------


def model_source(args: argparse.Namespace, scratch: Path) -> ModelSource:
    """SmolLM2 from the registry, or a word-level tokenizer and random weights in the shape."""
    shape = SHAPES[args.shape]
    if shape.hf_config is None:
        weights = f"GGUF Q4_1 weights dequantized to {args.dtype}"
        return ModelSource(resolve_model(DEFAULT_MODEL), None, f"{DEFAULT_MODEL} ({weights})")
    tokenizer_dir = scratch / "tokenizer"
    write_tokenizer(tokenizer_dir, shape.hf_config["vocab_size"])
    checkpoint = random_checkpoint(shape.hf_config, tokenizer_dir, device=args.device)
    name = "the Llama-3.1-8B shape" if args.shape == "8B" else f"a {args.shape} Llama shape"
    description = f"random BF16 weights in {name}, run in {args.dtype}"
    return ModelSource(tokenizer_dir, checkpoint, description)


def kv_spec(args: argparse.Namespace, tiers: TierConfig | None = None) -> KVCacheSpec:
    """The KV pools: a byte budget on the CPU, a share of device memory on CUDA."""
    return KVCacheSpec(
        tiers=tiers or TierConfig(), cpu_cache_mb=args.kv_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip


def cold_config(args: argparse.Namespace, target: str, **overrides: object) -> ColdTierConfig:
    """The engine's cold tier on the bench's kvstore."""
    return ColdTierConfig(
        target=target, deadline_ms=args.deadline_ms, transfer_deadline_ms=args.transfer_deadline_ms,
        local_reads=args.local_reads, **overrides,  # type: ignore[arg-type]
    )  # fmt: skip


def on_fresh_engine(
    source: ModelSource,
    args: argparse.Namespace,
    cold: ColdTierConfig | None,
    kv: KVCacheSpec,
    label: str,
    notes: list[str],
    work: Callable[[LLMEngine], T],
) -> T:
    """Load an engine, run `work` on it, then stop and free it: the next engine sizes its pools
    from the device memory left, so this one's must be gone first (the engine lives in this frame
    alone)."""
    before = device_memory(args.device)
    engine = LLMEngine.load(
        source.path, device=args.device, dtype=args.dtype, max_batch_size=1,
        max_seq_len=args.max_seq_len, progress=False, kv=kv, cold=cold,
        max_prefill_tokens=args.max_prefill_tokens, cuda_graphs=args.cuda_graphs,
        checkpoint=source.checkpoint,
    )  # fmt: skip
    capacity = engine.capacity.describe() if engine.capacity is not None else "set by hand"
    after = device_memory(args.device)
    memory = f"; device memory in use: {before} before load, {after} after" if before else ""
    notes.append(f"- {label}: {capacity}{memory}")
    print(notes[-1], flush=True)
    engine.start()
    try:
        return work(engine)
    finally:
        engine.stop()
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def device_memory(device: str) -> str:
    """Device memory in use (CUDA: a freed engine's pools must be gone before the next is sized)."""
    if device != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info()
    return f"{(total - free) / 2**30:.1f} of {total / 2**30:.0f} GiB"


def timed(engine: LLMEngine, prompt: list[int], params: SamplingParams, mode: str = "") -> GenerationResult:
    """Run one request on the engine's thread; TTFT and latency as the collector saw them."""
    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector, retrieval_mode=mode)
    if not collector.done.wait(REQUEST_TIMEOUT_S):
        raise TimeoutError(f"a {len(prompt)}-token request did not finish in {REQUEST_TIMEOUT_S:.0f} s")
    result = collector.result()
    if result.error:
        raise RuntimeError(f"the request failed: {result.error}")
    return result


def prompt_of(vocab_size: int, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` random ids, distinct per seed (so no run reuses another's prefix)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(num_tokens)]


# --- prefix reuse ---------------------------------------------------------------------------------


def prefix_reuse(
    source: ModelSource, target: str, args: argparse.Namespace, notes: list[str]
) -> list[PrefixRun]:
    """TTFT of the same prompts: recompute, first with the cold tier (miss), a new replica (hit)."""
    kv, cold = kv_spec(args), cold_config(args, target)
    with KVStoreClient(target, Namespace("bench", "bench")) as store:
        recompute = on_fresh_engine(
            source, args, None, kv, "recompute engine", notes,
            lambda e: run_prompts(e, store, args, notes, "recompute engine"),
        )  # fmt: skip
        miss = on_fresh_engine(
            source, args, cold, kv, "miss engine", notes,
            lambda e: run_prompts(e, store, args, notes, "miss engine", flush=True),
        )  # fmt: skip
        hit, per_token = on_fresh_engine(
            source, args, cold, kv, "hit engine", notes,
            lambda e: (run_prompts(e, store, args, notes, "hit engine"), kv_bytes_per_token(e.config)),
        )  # fmt: skip
    return [PrefixRun(*requests, per_token) for requests in zip(recompute, miss, hit, strict=True)]


def run_prompts(
    engine: LLMEngine,
    store: KVStoreClient,
    args: argparse.Namespace,
    notes: list[str],
    label: str,
    flush: bool = False,
) -> list[Request]:
    """The warm-up pair, then each repeat's prompt; `flush` waits until its blocks are stored.

    On CUDA a full-length prompt warms up too: a hit's first long load pins its host buffer
    (cudaHostAlloc, about a second per few GB), which torch's pinned-memory cache then reuses for
    loads of the same size class; its TTFT goes into the notes, the repeats time the steady state.
    """  # fmt: skip
    vocab = engine.config.vocab_size
    params = SamplingParams(max_new_tokens=args.max_new, temperature=0.0, ignore_eos=True)
    warmup = prompt_of(vocab, WARMUP_TOKENS + WARMUP_EXTRA_TOKENS, seed=WARMUP_SEED)
    for prompt in (warmup[:WARMUP_TOKENS], warmup):  # the second hits the first's blocks
        run_one(engine, store, prompt, params, flush)
    if args.device == "cuda":
        first = run_one(engine, store, prompt_of(vocab, args.prefix, seed=WARMUP_SEED + 1), params, flush)
        notes.append(
            f"- {label}, full-length warm-up prompt: TTFT {first.ttft_ms:.0f} ms, "
            f"{first.tokens_loaded} tokens loaded ({first.blocks_read_locally} blocks read locally)"
        )
    requests = []
    for repeat in range(args.repeats):
        requests.append(run_one(engine, store, prompt_of(vocab, args.prefix, seed=repeat), params, flush))
        print(f"  repeat {repeat}: {requests[-1]}"[:300], flush=True)
    return requests


def run_one(
    engine: LLMEngine, store: KVStoreClient, prompt: list[int], params: SamplingParams, flush: bool
) -> Request:
    """One request, and what it moved through the cold tier and the kvstore."""
    before = reading(engine, store)
    result = timed(engine, prompt, params)
    if flush and engine.cold is not None:
        engine.cold.tier.flush()  # the prompt's blocks are durable in the store
    after = reading(engine, store)
    return Request(
        result.ttft_ms, result.token_ids,
        *(a - b for a, b in zip(after, before, strict=True)),
    )  # fmt: skip


def reading(engine: LLMEngine, store: KVStoreClient) -> Reading:
    """The engine's cold-tier and prefill counters, and the kvstore's bytes and blocks served."""
    stats = engine.stats()
    cold = stats.cold
    served = store.stats()
    return Reading(
        cold.prompt_tokens_loaded if cold else 0, stats.num_prefill_tokens_computed,
        cold.degradations if cold else 0, served.used_bytes, served.staging_hits + served.disk_reads,
        cold.prefix_blocks_read_locally if cold else 0,
    )  # fmt: skip


def kv_bytes_per_token(config: ModelConfig) -> int:
    """A stored prompt block's payload per token: BF16 keys and values of every layer."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2


# --- the auxiliary window -------------------------------------------------------------------------


def prefetch(source: ModelSource, target: str, args: argparse.Namespace, notes: list[str]) -> WindowRun:
    """One long generation with the auxiliary window on, and the same one with it off."""
    tiers = TierConfig(
        enabled=True, sink_tokens=4, hot_tokens=args.hot, warm_tokens=args.warm, group_size=args.group
    )
    cold = cold_config(
        args, target, prefix_reuse=False, aux_window_tokens=args.window, score_every_steps=args.score_every,
        prefetch_blocks=args.prefetch_blocks,
    )  # fmt: skip
    return on_fresh_engine(
        source, args, cold, kv_spec(args, tiers), "window engine", notes,
        lambda e: window_run(e, args, target),
    )  # fmt: skip


def window_run(engine: LLMEngine, args: argparse.Namespace, target: str) -> WindowRun:
    """The window-off request, then the window-on one, on one engine."""
    prompt = prompt_of(engine.config.vocab_size, args.window_prompt, seed=1000)
    params = SamplingParams(max_new_tokens=args.window_new, temperature=0.0, ignore_eos=True)
    off = timed(engine, prompt, params, mode="off")
    with KVStoreClient(target, Namespace("bench", "bench")) as store:
        before = store.stats()
        on = timed(engine, prompt, params, mode="semantic")
        assert engine.cold is not None
        engine.cold.tier.flush()
        after = store.stats()
    stats = engine.stats().cold
    assert stats is not None
    steps = args.window_new - 1
    return WindowRun(
        stats.window_loads, stats.window_loads_in_time, stats.blocks_demoted,
        (on.latency_ms - on.ttft_ms) / steps, (off.latency_ms - off.ttft_ms) / steps, stats.degradations,
        stats.blocks_prefetched, after.staging_hits - before.staging_hits,
        after.disk_reads - before.disk_reads,
    )  # fmt: skip


# --- the results page -----------------------------------------------------------------------------


def environment(args: argparse.Namespace, data_dir: Path) -> dict[str, str]:
    """Date, commit, machine and where the segments lived."""
    commit = os.environ.get("THERMOCLINE_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "services/engine", "services/common", "services/kvstore")
    hardware = f"CPU {cpu_name()}, {os.cpu_count()} logical CPUs"
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        hardware = f"GPU {torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.0f} GiB; {hardware}"
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", str(data_dir)], capture_output=True, text=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + (" (engine/kvstore files modified)" if dirty else ""),
        "hardware": hardware,
        "software": f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"Python {platform.python_version()}",
        "segments": f"{data_dir} ({filesystem.stdout.strip() or 'filesystem unknown'})",
    }


def git(*arguments: str) -> str:
    """A git command's output, or nothing where there is no repository (a copied tree)."""
    try:
        done = subprocess.run(["git", *arguments], capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every setting spelled out."""
    words = ["python", "bench/cold_tier.py"]
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if name == "local_reads" and value is False:
            words.append("--no-local-reads")
        if name in ("out", "redis_server", "data_dir") or value is None or value is False:
            continue
        words += [flag] if value is True else [flag, str(value)]
    return " ".join(words)


def to_markdown(
    args: argparse.Namespace,
    env: dict[str, str],
    source: ModelSource,
    runs: list[PrefixRun],
    window: WindowRun | None,
    notes: list[str],
) -> str:
    """The results page."""
    where = "the H200" if args.device == "cuda" else "the CPU"
    lines = [
        f"# Cold tier on {where}: prefix reuse"
        + ("" if window is None else " and the auxiliary window's prefetch"),
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}; {env['software']}",
        f"- model: {source.description}; one kvstore process and one redis-server on loopback, "
        f"segments in {env['segments']}",
        f"- settings: device {args.device}, dtype {args.dtype}, prefill chunks of {args.max_prefill_tokens} "
        f"tokens, max_seq_len {args.max_seq_len}, CUDA graphs {'on' if args.cuda_graphs else 'off'}, "
        f"GPU memory utilization {args.gpu_memory_utilization} (CPU KV budget {args.kv_mb} MB), kvstore "
        f"deadlines {args.deadline_ms} ms (lookups) and {args.transfer_deadline_ms} ms (transfers); prefix "
        + (
            "loads by same-host reads (LocateBlocks, then the engine reads and checks the segment records)"
            if args.local_reads
            else "loads by the GetBlocks stream"
        ),
        f"- reproduce: `{command_line(args)}`",
    ]
    if runs:
        lines += prefix_section(args, runs)
    if window is not None:
        lines += window_section(args, window)
    lines += ["", "## Engines", "", *notes]
    return "\n".join(lines) + "\n"


def prefix_section(args: argparse.Namespace, runs: list[PrefixRun]) -> list[str]:
    """The prefix-reuse table and its medians."""
    recompute = statistics.median(r.recompute.ttft_ms for r in runs)
    hit = statistics.median(r.hit.ttft_ms for r in runs)
    lines = [
        "",
        f"## Prefix reuse: TTFT of a {args.prefix}-token prompt",
        "",
        "Three engines, one at a time, each freed before the next loads; a distinct prompt per repeat:",
        "without a cold tier (recompute), with it (computes, misses, stores its prompt blocks in the",
        "background; the bench waits for them), and a third with it (a new replica: loads the stored",
        "prefix and computes the last block). Each engine ran a short warm-up pair first. The hit reads",
        "segments the miss has just written, from the page cache, not the disk: "
        + ("by its own reads of the segment files." if args.local_reads else "through the GetBlocks stream."),
        "",
        "| repeat | recompute (ms) | miss + store (ms) | hit (ms) | speed-up | tokens loaded | "
        "prefill tokens computed on the hit | bytes stored (MB) | bytes loaded (MB) | blocks read locally "
        "| blocks streamed | load rate (GB/s of hit TTFT) | degradations (miss, hit) | "
        "greedy equal (hit, miss) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for n, r in enumerate(runs):
        lines.append(
            f"| {n} | {r.recompute.ttft_ms:.0f} | {r.miss.ttft_ms:.0f} | {r.hit.ttft_ms:.0f} | "
            f"{r.recompute.ttft_ms / r.hit.ttft_ms:.1f}x | {r.hit.tokens_loaded} | "
            f"{r.hit.prefill_tokens_computed} | {r.miss.bytes_stored / 1e6:.1f} | "
            f"{r.bytes_loaded / 1e6:.1f} | {r.hit.blocks_read_locally} | "
            f"{r.hit.blocks_served} | {r.bytes_loaded / 1e6 / r.hit.ttft_ms:.2f} | "
            f"{r.miss.degradations}, {r.hit.degradations} | "
            f"{r.hit.token_ids == r.recompute.token_ids}, {r.miss.token_ids == r.recompute.token_ids} |"
        )
    return [
        *lines,
        "",
        f"Median: recompute {recompute:.0f} ms, hit {hit:.0f} ms: **{recompute / hit:.1f}x shorter TTFT** "
        "(the issue's goal is at least 5x).",
    ]


def window_section(args: argparse.Namespace, window: WindowRun) -> list[str]:
    """The prefetch table."""
    return [
        "",
        "## Auxiliary window: prefetch",
        "",
        f"A {args.window_prompt}-token prompt and {args.window_new} greedy tokens with the tiers on (sink 4, "
        f"hot {args.hot}, warm {args.warm}, group {args.group}); window {args.window} tokens, scored every "
        f"{args.score_every} decode steps.",
        "",
        "| cold blocks demoted | window loads | loads hidden (mapped by the next step) | hidden share | "
        "runner-ups prefetched | blocks the store served from RAM / disk | "
        "TPOT window on (ms) | TPOT window off (ms) | degradations |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {window.blocks_demoted} | {window.window_loads} | {window.hidden_loads} | "
        f"{window.hidden_loads / max(window.window_loads, 1):.0%} | {window.blocks_prefetched} | "
        f"{window.served_from_ram} / {window.served_from_disk} | {window.tpot_window_ms:.1f} | "
        f"{window.tpot_off_ms:.1f} | {window.degradations} |",
    ]


# --- the command ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The settings; a shape's defaults fill what is not given."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="smollm2", metavar="{smollm2,8B}",
        help="8B: random BF16 weights in the Llama-3.1-8B shape (tiny: a random shape for CPU checks)",
    )  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--prefix", type=int, default=None, help="prompt tokens (8176 for smollm2, 32768 for 8B)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument(
        "--dtype", default=None, help="smollm2: float32 (the loaded prefix is rounded to BF16)"
    )
    parser.add_argument("--max-seq-len", type=int, default=None, help="smollm2: 8192; else the prefix's need")
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="prefill chunk (8B: 16384)")
    parser.add_argument("--cuda-graphs", action="store_true", help="capture decode (TTFT is prefill: off)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--kv-mb", type=int, default=1024, help="CPU KV budget")
    parser.add_argument("--deadline-ms", type=int, default=10_000)
    parser.add_argument("--transfer-deadline-ms", type=int, default=TRANSFER_DEADLINE_MS)
    parser.add_argument("--window-prompt", type=int, default=2048)
    parser.add_argument("--window-new", type=int, default=129)
    parser.add_argument("--hot", type=int, default=256)
    parser.add_argument("--warm", type=int, default=512)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--score-every", type=int, default=16)
    parser.add_argument(
        "--prefetch-blocks", type=int, default=-1,
        help="runner-ups staged at each scoring (-1: as many as the window holds; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--local-reads", action=argparse.BooleanOptionalAction, default=True,
        help="hits read the stored prefix from the segment files (the kvstore runs on this host); "
        "--no-local-reads: by the GetBlocks stream",
    )  # fmt: skip
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-window", action="store_true", help="prefix reuse alone (any shape)")
    parser.add_argument(
        "--redis-server", type=Path, default=os.environ.get("THERMOCLINE_REDIS_SERVER") or None,
        help="the redis-server to run (default $THERMOCLINE_REDIS_SERVER, else the PATH's)",
    )  # fmt: skip
    parser.add_argument("--data-dir", type=Path, default=None, help="where the segments go (a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    return with_defaults(parser, args)


def with_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the shape's defaults and refuse what cannot run."""
    if args.shape not in SHAPES:
        parser.error(f"--shape {args.shape}: not one of {', '.join(SHAPES)}")
    shape = SHAPES[args.shape]
    args.prefix = args.prefix or shape.prefix_tokens
    args.dtype = args.dtype or shape.dtype
    args.max_prefill_tokens = args.max_prefill_tokens or shape.max_prefill_tokens
    if args.max_seq_len is None:
        longest = max(args.prefix, WARMUP_TOKENS + WARMUP_EXTRA_TOKENS) + args.max_new + 16
        args.max_seq_len = 8192 if shape.hf_config is None else longest
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if shape.hf_config is not None and not args.skip_window:
        parser.error(
            "the window part runs on SmolLM2 only (its scoring needs trained weights): add --skip-window"
        )
    if args.skip_prefix and args.skip_window:
        parser.error("--skip-prefix and --skip-window leave nothing to measure")
    return args


def main() -> None:
    """Run the measurements and print (or write) the results page."""
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cold-tier-bench-") as tmp:
        directory = Path(tmp)
        data_dir = args.data_dir or directory / "kvstore"
        source = model_source(args, directory)
        redis = RedisServer(directory, binary=args.redis_server).start()
        serving = {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"} if args.local_reads else {}
        kvstore = KVStoreProcess(data_dir, redis.url, serving).start()
        os.environ[TOKEN_FILE_SETTING] = str(kvstore.service_token_path)  # call it as the engine does
        try:
            started = time.perf_counter()
            window = None if args.skip_window else prefetch(source, kvstore.target, args, notes)
            print(window, flush=True)
            runs = [] if args.skip_prefix else prefix_reuse(source, kvstore.target, args, notes)
            notes.append(
                f"- the whole run took {time.perf_counter() - started:.0f} s after the store started"
            )
            print(notes[-1], flush=True)
        finally:
            kvstore.stop()
            redis.stop()
        markdown = to_markdown(args, environment(args, data_dir), source, runs, window, notes)
    print(markdown)
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")


if __name__ == "__main__":
    main()
