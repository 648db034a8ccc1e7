"""The engine's cold tier on the CPU: prefix reuse (TTFT, hit against recompute) and the auxiliary window's
prefetch (the share of cold-block loads that decode never waited for).

Starts a redis-server and a kvstore process (the test suite's helpers), then, on SmolLM2-135M:
- **Prefix reuse.** A `--prefix`-token prompt (distinct per repeat) through three fresh engines
  in one process: one without a cold tier (recompute: the baseline), one with it (computes,
  looks up and misses, stores its prompt blocks in the background), and a second one with it,
  as a new replica would (looks up, loads the stored prefix, computes the last token). TTFT is
  submit -> first token, on the engine's own thread; `--max-new` tokens after it check that the
  hit's greedy output equals the recompute's.
- **Prefetch.** One long generation in retrieval mode `semantic` with the tiers on: warm overflow
  is demoted to the store, every `--score-every` decode steps the query scores the cold blocks,
  and the chosen ones are loaded on the loader thread. A load counts as hidden when it was
  mapped by the step after the one that chose it (decode never waits for a load either way; a
  late load is attended late). Time per output token with the window on is set against the
  same request with the window off.

    .venv/bin/python bench/cold_tier.py --out bench/results/cold_tier_cpu_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from services.engine.kv.cold_tier import ColdTierConfig
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import GenerationResult, ResultCollector
from tests.kvstore.conftest import KVStoreProcess, RedisServer


@dataclass(frozen=True)
class PrefixRun:
    """One repeat of the prefix-reuse comparison."""

    recompute_ms: float
    miss_and_store_ms: float
    hit_ms: float
    tokens_loaded: int
    prefill_tokens_hit: int
    outputs_equal: bool


@dataclass(frozen=True)
class WindowRun:
    """The auxiliary-window generation, and the same request with the window off."""

    window_loads: int
    hidden_loads: int
    blocks_demoted: int
    tpot_window_ms: float
    tpot_off_ms: float
    degradations: int


def load(model: Path, args: argparse.Namespace, cold: ColdTierConfig | None, kv: KVCacheSpec) -> LLMEngine:
    """A fresh engine (a new replica: nothing in its hot prefix cache)."""
    return LLMEngine.load(
        model, device="cpu", dtype=args.dtype, max_batch_size=1, max_seq_len=args.max_seq_len,
        progress=False, kv=kv, cold=cold,
    )  # fmt: skip


def timed(engine: LLMEngine, prompt: list[int], params: SamplingParams, mode: str = "") -> GenerationResult:
    """Run one request on the engine's thread; TTFT and latency as the collector saw them."""
    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector, retrieval_mode=mode)
    collector.done.wait()
    return collector.result()


def prompt_of(engine: LLMEngine, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` of text-like ids, distinct per seed (so no run reuses another's prefix)."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    return [rng.randrange(100, vocab) for _ in range(num_tokens)]


def prefix_reuse(model: Path, target: str, args: argparse.Namespace) -> list[PrefixRun]:
    """TTFT of the same prompt: recompute, first with the cold tier (miss), a new replica (hit)."""
    kv = KVCacheSpec(cpu_cache_mb=args.kv_mb)
    cold = ColdTierConfig(target=target, deadline_ms=args.deadline_ms)
    params = SamplingParams(max_new_tokens=args.max_new, temperature=0.0)
    runs = []
    for repeat in range(args.repeats):
        engines = [load(model, args, None, kv), load(model, args, cold, kv), load(model, args, cold, kv)]
        for engine in engines:
            engine.start()
        prompt = prompt_of(engines[0], args.prefix, seed=repeat)
        recompute = timed(engines[0], prompt, params)
        miss = timed(engines[1], prompt, params)
        assert engines[1].cold is not None
        engines[1].cold.tier.flush()  # the prompt's blocks are durable in the store
        hit = timed(engines[2], prompt, params)
        stats = engines[2].stats()
        assert stats.cold is not None
        equal = hit.token_ids == recompute.token_ids
        loaded, computed = stats.cold.prompt_tokens_loaded, stats.num_prefill_tokens_computed
        runs.append(PrefixRun(recompute.ttft_ms, miss.ttft_ms, hit.ttft_ms, loaded, computed, equal))
        print(runs[-1], flush=True)
        for engine in engines:
            engine.stop()
    return runs


def prefetch(model: Path, target: str, args: argparse.Namespace) -> WindowRun:
    """One long generation with the auxiliary window on, and the same one with it off."""
    tiers = TierConfig(
        enabled=True, sink_tokens=4, hot_tokens=args.hot, warm_tokens=args.warm, group_size=args.group
    )
    kv = KVCacheSpec(cpu_cache_mb=args.kv_mb, tiers=tiers)
    cold = ColdTierConfig(
        target=target, deadline_ms=args.deadline_ms, prefix_reuse=False,
        aux_window_tokens=args.window, score_every_steps=args.score_every,
    )  # fmt: skip
    engine = load(model, args, cold, kv)
    engine.start()
    prompt = prompt_of(engine, args.window_prompt, seed=1000)
    params = SamplingParams(max_new_tokens=args.window_new, temperature=0.0)
    off = timed(engine, prompt, params, mode="off")
    on = timed(engine, prompt, params, mode="semantic")
    stats = engine.stats().cold
    assert stats is not None
    steps = args.window_new - 1
    engine.stop()
    return WindowRun(
        stats.window_loads, stats.window_loads_in_time, stats.blocks_demoted,
        (on.latency_ms - on.ttft_ms) / steps, (off.latency_ms - off.ttft_ms) / steps, stats.degradations,
    )  # fmt: skip


def environment() -> dict[str, str]:
    """Date, commit and machine."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "services/engine", "services/common", "services/kvstore"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    cpu = cpu_name()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + (" (engine/kvstore files modified)" if dirty else ""),
        "hardware": f"CPU {cpu}, {os.cpu_count()} logical CPUs (shared with other work)",
    }


def to_markdown(
    args: argparse.Namespace, env: dict[str, str], runs: list[PrefixRun], window: WindowRun
) -> str:
    """The results page."""
    recompute = statistics.median(r.recompute_ms for r in runs)
    hit = statistics.median(r.hit_ms for r in runs)
    lines = [
        "# Cold tier on the CPU: prefix reuse and the auxiliary window's prefetch",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}",
        f"- model: {DEFAULT_MODEL} (GGUF Q4_1 weights dequantized to {args.dtype}); one kvstore process "
        "and one redis-server on loopback, segments on the local disk",
        f"- reproduce: `.venv/bin/python bench/cold_tier.py --prefix {args.prefix} --repeats {args.repeats} "
        f"--max-new {args.max_new} --dtype {args.dtype} --window-prompt {args.window_prompt} "
        f"--window-new {args.window_new} --hot {args.hot} --warm {args.warm} --group {args.group} "
        f"--window {args.window} --score-every {args.score_every}`",
        "",
        f"## Prefix reuse: TTFT of a {args.prefix}-token prompt",
        "",
        "Three fresh engines per repeat (a distinct prompt each): without a cold tier (recompute), with it",
        "(computes, misses, stores its prompt blocks in the background), and a second one with it (a new",
        "replica: loads the stored prefix and computes the last token).",
        "",
        "| repeat | recompute (ms) | cold tier, miss + store (ms) | cold tier, hit (ms) | speed-up | "
        "tokens loaded | prefill tokens computed on the hit | greedy output equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(runs):
        lines.append(
            f"| {n} | {r.recompute_ms:.0f} | {r.miss_and_store_ms:.0f} | {r.hit_ms:.0f} | "
            f"{r.recompute_ms / r.hit_ms:.1f}x | {r.tokens_loaded} | {r.prefill_tokens_hit} | "
            f"{r.outputs_equal} |"
        )
    lines += [
        "",
        f"Median: recompute {recompute:.0f} ms, hit {hit:.0f} ms: **{recompute / hit:.1f}x shorter TTFT** "
        "(the issue's goal is at least 5x).",
        "",
        "## Auxiliary window: prefetch",
        "",
        f"A {args.window_prompt}-token prompt and {args.window_new} greedy tokens with the tiers on (sink 4, "
        f"hot {args.hot}, warm {args.warm}, group {args.group}); window {args.window} tokens, scored every "
        f"{args.score_every} decode steps.",
        "",
        "| cold blocks demoted | window loads | loads hidden (mapped by the next step) | hidden share | "
        "TPOT window on (ms) | TPOT window off (ms) | degradations |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {window.blocks_demoted} | {window.window_loads} | {window.hidden_loads} | "
        f"{window.hidden_loads / max(window.window_loads, 1):.0%} | {window.tpot_window_ms:.1f} | "
        f"{window.tpot_off_ms:.1f} | {window.degradations} |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run both measurements and print (or write) the results page."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix", type=int, default=8192 - 16, help="prompt tokens (SmolLM2 holds 8192)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="float32: the loaded prefix is rounded to BF16")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--kv-mb", type=int, default=1024)
    parser.add_argument("--deadline-ms", type=int, default=10_000)
    parser.add_argument("--window-prompt", type=int, default=2048)
    parser.add_argument("--window-new", type=int, default=129)
    parser.add_argument("--hot", type=int, default=256)
    parser.add_argument("--warm", type=int, default=512)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--score-every", type=int, default=16)
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = resolve_model(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory(prefix="cold-tier-bench-") as tmp:
        directory = Path(tmp)
        redis = RedisServer(directory).start()
        kvstore = KVStoreProcess(directory / "kvstore", redis.url).start()
        try:
            started = time.perf_counter()
            window = prefetch(model, kvstore.target, args)
            print(window, flush=True)
            runs = [] if args.skip_prefix else prefix_reuse(model, kvstore.target, args)
            print(f"took {time.perf_counter() - started:.0f} s", flush=True)
        finally:
            kvstore.stop()
            redis.stop()
    if not runs:
        return
    markdown = to_markdown(args, environment(), runs, window)
    print(markdown)
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")


if __name__ == "__main__":
    main()
