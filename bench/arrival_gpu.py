# ruff: noqa: E501  (markdown table rows and their f-strings read better unwrapped)
"""A long prompt arrives while other requests decode: how long do the running streams wait for their
next token, and what does the arrival's TTFT become? With mixed steps (the engine's default) every
step decodes a token for each running stream beside a prompt chunk; without them the prompt's chunks
run first and the streams wait for its whole prefill.

    python bench/arrival_gpu.py --out $OUT/arrival.md
    python bench/arrival_gpu.py --streams 16 --stream-prompt 1024 --prompt 32768 --tiers on,off --mixed on,off

Llama-3.1-8B shape, random bf16 weights, greedy, EOS ignored, prefill chunks of 4,096 tokens. One
engine per tiers setting; mixed steps are switched on the same engine (`Scheduler.mixed_steps`), in
turn, after a warm-up of both. Steps are run by hand and timed on the host (each step ends with its
sync). Needs a CUDA GPU; bench/arrival_vllm.py runs the same scenario on vLLM.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from decode_gpu import LLAMA_8B, TIERS_ON, load, random_checkpoint, run_commit, write_tokenizer

from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine, SamplingParams
from services.engine.serving.generation_result import ResultCollector


def arrival(engine: LLMEngine, vocab: int, streams: int, stream_prompt: int, prompt: int, seed: int) -> dict:
    """Start `streams` requests, let them decode, then submit one `prompt`-token request; step by hand
    until it has its first token and the streams have decoded 8 more. Returns the figures of one run.
    Each `seed` must be new to the engine, or the prefix cache serves the prompts."""
    generator = torch.Generator().manual_seed(seed)
    stream_prompts = torch.randint(2, vocab, (streams, stream_prompt), generator=generator).tolist()
    long_prompt = torch.randint(2, vocab, (prompt,), generator=generator).tolist()
    endless = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
    for p in stream_prompts:
        engine.submit(p, endless, ResultCollector(p))
    while len(engine.scheduler.running) < streams or any(
        not s.completion_ids for s in engine.scheduler.running
    ):
        engine.step()
    watched = engine.scheduler.running[0]
    steady = []  # decode steps of the streams alone
    for _ in range(16):
        before = time.perf_counter()
        engine.step()
        steady.append((time.perf_counter() - before) * 1e3)
    known = {id(s) for s in engine.scheduler.running}
    engine.submit(
        long_prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), ResultCollector(long_prompt)
    )
    submitted = time.perf_counter()
    token_times = [submitted]  # when the watched stream got each token, from the submission on
    tokens = len(watched.completion_ids)
    arrived = None  # the arriving request's sequence, once admitted
    first_token_s, tokens_during = None, 0
    step_ms = []
    while first_token_s is None or len(token_times) < tokens_during + 9:
        before = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        step_ms.append((now - before) * 1e3)
        if len(watched.completion_ids) > tokens:
            tokens = len(watched.completion_ids)
            token_times.append(now)
        if arrived is None:
            arrived = next((s for s in engine.scheduler.running if id(s) not in known), None)
        if first_token_s is None and arrived is not None and arrived.completion_ids:
            first_token_s = now - submitted
            tokens_during = len(token_times) - 1
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(token_times)]
    for seq in list(engine.scheduler.running):  # the streams and the arrival
        engine.cancel(seq.request_id)
    while engine.scheduler.has_work:
        engine.step()
    assert first_token_s is not None
    return {
        "steady_ms": statistics.median(steady),
        "ttft_ms": first_token_s * 1e3,
        "longest_gap_ms": max(gaps),
        "tokens_during": tokens_during,
        "steps": len(step_ms),
        "step_ms": step_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-prompt", type=int, default=1024)
    parser.add_argument(
        "--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[32_768],
        help="arriving prompt lengths, each run in turn (a new length builds new kernel plans)",
    )  # fmt: skip
    parser.add_argument("--prefill", type=int, default=4096, help="max prefill tokens per step")
    parser.add_argument("--tiers", default="on,off", type=lambda s: s.split(","))
    parser.add_argument("--mixed", default="on,off", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    commit = run_commit()
    rows = [
        "# A long prompt arriving while streams decode (bench/arrival_gpu.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {commit}",
        f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}",
        f"- settings: {vars(args)}; tiers on: {TIERS_ON}",
        "- scenario: the streams decode; then one long prompt arrives. `longest gap`: the longest time"
        " one running stream waited for a token from the arrival until the arrival's first token and 8 more"
        " of the stream's; `tokens during`: the stream's tokens before the arrival's first; `steady`: a"
        " decode step of the streams alone (median of 16)",
        "",
        "| tiers | mixed steps | streams x prompt | arriving prompt | steady step ms | arrival TTFT ms | longest gap ms | tokens during | steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    flush = lambda: args.out.write_text("\n".join(rows) + "\n") if args.out else None  # noqa: E731
    seq_len = max(args.prompts) + 64
    seeds = itertools.count()  # every run's prompts are new: no prefix is reused from an earlier run
    with tempfile.TemporaryDirectory() as tmp:
        tokdir = Path(tmp) / "tokenizer"
        write_tokenizer(tokdir, LLAMA_8B["vocab_size"])
        checkpoint = random_checkpoint(LLAMA_8B, tokdir)
        for tiers in args.tiers:
            kv = KVCacheSpec(tiers=TIERS_ON) if tiers == "on" else KVCacheSpec()
            engine = load(checkpoint, tokdir, args.streams + 1, seq_len, kv, args.prefill)
            vocab = LLAMA_8B["vocab_size"]
            # warm-up: the chunk shapes (whole and over a warm or hot prefix) with and without decode rows
            for mixed in args.mixed:
                engine.scheduler.mixed_steps = mixed == "on"
                arrival(
                    engine,
                    vocab,
                    args.streams,
                    args.stream_prompt,
                    min(args.prompts[0], 2 * 4096 + 300),
                    next(seeds),
                )
            for prompt, _repeat, mixed in itertools.product(args.prompts, range(args.repeats), args.mixed):
                engine.scheduler.mixed_steps = mixed == "on"
                r = arrival(engine, vocab, args.streams, args.stream_prompt, prompt, next(seeds))
                rows.append(
                    f"| {tiers} | {mixed} | {args.streams} x {args.stream_prompt} | {prompt} | "
                    f"{r['steady_ms']:.1f} | {r['ttft_ms']:.0f} | {r['longest_gap_ms']:.0f} | "
                    f"{r['tokens_during']} | {r['steps']} |"
                )
                print(rows[-1], "steps (ms):", " ".join(f"{ms:.0f}" for ms in r["step_ms"]), flush=True)
                flush()
            engine.stop()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    print("\n".join(rows))
    flush()


if __name__ == "__main__":
    main()
