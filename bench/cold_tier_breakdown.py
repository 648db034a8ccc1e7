"""Where a cold-tier prefix hit's time goes: one stored prompt, one hit, every phase timed.

Starts a redis-server and a kvstore process (the test suite's helpers, as bench/cold_tier.py), has
one engine compute and store a `--prefix`-token prompt, then times the same prompt on a fresh
engine (a new replica) that loads it. The hit's phases are timed by wrapping the functions that
carry them out, on whichever thread runs them:

- loader thread: the Lookup (or LocateBlocks), the block fetch (the GetBlocks stream, or the
  same-host reads and their CRC checks), the copies into the KV cache (since they moved onto the
  loader thread, a piece at a time), and at older commits the decode of each block;
- engine thread: taking the outcome, placing the blocks (`attach_prefix`), the copy into the KV
  cache (`write_loaded`), and the forward (its first call is the prefill of the last block);
- the store side, in this process on the same segment files: reading the records (pread) and
  checking them (CRC and copies), which the GetBlocks stream pays before it sends a byte.

Each hit runs once per `--paths` entry (the stream, then same-host reads) on the same stored
prompts. Functions a commit lacks are skipped, so the script also times older commits. On CUDA the
spans time the host side (launches and waits), not the device.

    .venv/bin/python bench/cold_tier_breakdown.py            # SmolLM2, an 8176-token prefix
    .venv/bin/python bench/cold_tier_breakdown.py --shape tiny --prefix 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cold_tier import SHAPES, cold_config, kv_spec, model_source, prompt_of, timed
from services.common import kvstore_api, segment_reader
from services.common.service_auth import TOKEN_FILE_SETTING
from services.engine.execution import model_runner
from services.engine.kv import cache, cold_tier, prefix_fetch
from services.engine.llm_engine import EngineStats, LLMEngine
from services.engine.scheduling import cold_planner
from services.engine.scheduling.sampling_params import SamplingParams
from services.kvstore import record, segments
from tests.kvstore.conftest import KVStoreProcess, RedisServer


class Spans:
    """Wall-clock spans by name, from any thread, relative to `start`."""

    def __init__(self) -> None:
        self.start = 0.0
        self.by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._lock = threading.Lock()

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.by_name[name].append((began - self.start, time.perf_counter() - self.start))

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Time every call of `owner.attribute` as span `name`."""
        original = getattr(owner, attribute)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            with self.span(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed_call)

    def total_ms(self, name: str) -> float:
        return sum(end - began for began, end in self.by_name.get(name, [])) * 1e3

    def first_ms(self, name: str) -> tuple[float, float]:
        began, end = self.by_name[name][0]
        return began * 1e3, end * 1e3

    def clear(self, start: float) -> None:
        self.start = start
        self.by_name.clear()


SPANS = Spans()


def instrument() -> None:
    """Wrap the functions that carry out a hit's phases (those that exist at this commit)."""
    wraps = [
        (kvstore_api.KVStoreClient, "lookup", "lookup (Lookup RPC)"),
        (kvstore_api.KVStoreClient, "locate", "locate (LocateBlocks RPC)"),
        (kvstore_api.KVStoreClient, "get", "fetch: GetBlocks stream, whole blocks"),
        (kvstore_api.KVStoreClient, "get_into", "fetch: GetBlocks stream into the buffer"),
        (prefix_fetch.PrefixFetcher, "_host_buffer", "fetch: allocate the host buffer"),
        (segment_reader.SegmentReader, "read_run", "fetch: same-host reads + CRC"),
        (prefix_fetch.PrefixFetcher, "_read_locally", "fetch: locate, read, copy, a piece at a time"),
        (getattr(segment_reader, "PendingRun", None), "wait", "fetch: wait for a piece's reads"),
        (getattr(cache, "PrefixWriter", None), "write", "fetch: queue a piece's device copies"),
        (getattr(cache, "PrefixWriter", None), "finish", "fetch: wait for the device copies"),
        (cold_tier, "_decode", "decode blocks into tensors"),
        (cold_planner.ColdPlanner, "take_ready", "take outcomes (engine thread)"),
        (cold_planner.ColdPlanner, "attach_prefix", "attach_prefix (engine thread)"),
        (cache.KVCache, "write_loaded", "write_loaded: into the KV cache"),
        (model_runner.ModelRunner, "prepare", "prepare the step (host metadata)"),
        (model_runner.ModelRunner, "_forward", "forward, write_loaded included"),
        (LLMEngine, "_run", "engine: run the step, sample"),
        (LLMEngine, "_commit", "engine: commit the step, emit tokens"),
    ]
    for owner, attribute, name in wraps:
        if hasattr(owner, attribute):
            SPANS.wrap(owner, attribute, name)
    run_job = cold_tier.ColdTier._run

    def timed_job(tier: cold_tier.ColdTier, job: cold_tier.Job) -> cold_tier.Outcome:
        with SPANS.span(f"kvstore job {job.operation.value}, all of it"):
            return run_job(tier, job)

    cold_tier.ColdTier._run = timed_job  # type: ignore[method-assign]


def store_side_ms(data_dir: Path, repeats: int = 2) -> dict[str, float]:
    """What the store pays per GetBlocks before it sends: pread of every record, then its check."""
    directory = data_dir / "segments"
    found = [
        item
        for seg in segments.list_segments(directory)
        for item in segments.scan_segment(directory, seg).records
    ]
    prefix = [f for f in found if not f.record.is_tombstone and f.record.codec == 1]
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        began = time.perf_counter()
        raw = [
            segments._pread(segments.segment_path(directory, f.location.segment_id), f.location)
            for f in prefix
        ]
        read = time.perf_counter()
        for f, data in zip(prefix, raw, strict=True):
            record.decode(data, f.location.segment_id, f.location.offset)
        checked = time.perf_counter()
        times["pread"].append((read - began) * 1e3)
        times["check (CRC, copies)"].append((checked - read) * 1e3)
    result = {name: min(values) for name, values in times.items()}
    result["records"] = float(len(prefix))
    result["MB"] = sum(f.location.length for f in prefix) / 1e6
    return result


def run(args: argparse.Namespace) -> None:
    """Store the prompt with one engine, then time its hit on fresh engines."""
    with tempfile.TemporaryDirectory(prefix="cold-tier-breakdown-") as tmp:
        directory = Path(tmp)
        source = model_source(args, directory)
        redis = RedisServer(directory, binary=args.redis_server).start()
        store_env = {"THERMOCLINE_KVSTORE_SERVE_LOCATIONS": "true"} | args.store_env
        kvstore = KVStoreProcess(directory / "kvstore", redis.url, store_env).start()
        os.environ[TOKEN_FILE_SETTING] = str(kvstore.service_token_path)  # call it as the engine does
        try:
            measure(args, source, kvstore, directory)
        finally:
            kvstore.stop()
            redis.stop()


def load(args: argparse.Namespace, source: Any, cold: cold_tier.ColdTierConfig | None) -> LLMEngine:
    return LLMEngine.load(
        source.path, device=args.device, dtype=args.dtype, max_batch_size=1, max_seq_len=args.max_seq_len,
        progress=False, kv=kv_spec(args), cold=cold, max_prefill_tokens=args.max_prefill_tokens,
        checkpoint=source.checkpoint,
    )  # fmt: skip


def measure(args: argparse.Namespace, source: Any, kvstore: KVStoreProcess, directory: Path) -> None:
    # the miss decodes a few tokens: its last prompt blocks are stored by the steps after the prefill
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    cold = cold_config(args, kvstore.target, **args.cold_overrides)
    miss = load(args, source, cold)
    miss.start()
    vocab = miss.config.vocab_size
    prompts = [prompt_of(vocab, args.prefix, seed=seed) for seed in range(args.repeats)]
    warmup = prompt_of(vocab, 320, seed=1_000_001)
    for prompt in (warmup[:256], warmup, *prompts):
        result = timed(miss, prompt, params)
        assert miss.cold is not None
        miss.cold.tier.flush()
        print(f"stored: {len(prompt)} tokens, TTFT {result.ttft_ms:.0f} ms", flush=True)
    miss.stop()
    del miss
    free_device_memory()
    print("store side:", store_side_ms(directory / "kvstore"), flush=True)
    instrument()
    for mode in args.paths:
        print(f"\n=== prefix loads by {mode} ===", flush=True)
        on_path = dataclasses.replace(cold, local_reads=mode == "local")
        for prompt in prompts:
            time_hit(args, source, on_path, prompt, warmup, params)


def free_device_memory() -> None:
    """Give a stopped engine's device memory back before the next one loads (its KV pools fill
    90% of the GPU: two at once do not fit)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_hit(
    args: argparse.Namespace,
    source: Any,
    cold: cold_tier.ColdTierConfig,
    prompt: list[int],
    warmup: list[int],
    params: SamplingParams,
) -> None:
    """One hit on a fresh engine (after its warm-up pair), its phases printed."""
    hit = load(args, source, cold)
    hit.start()
    for warm in (warmup[:256], warmup):
        timed(hit, warm, params)
    before = hit.stats()
    SPANS.clear(time.perf_counter())
    result = timed(hit, prompt, params)
    report(result.ttft_ms, before, hit.stats())
    hit.stop()
    del hit
    free_device_memory()


def report(ttft_ms: float, before: EngineStats, after: EngineStats) -> None:
    """The phases of one hit, in ms from submit, and what it loaded (counters after minus before)."""
    cold_before, cold_after = before.cold, after.cold
    assert cold_before is not None and cold_after is not None
    loaded = cold_after.prompt_tokens_loaded - cold_before.prompt_tokens_loaded
    local = cold_after.prefix_blocks_read_locally - cold_before.prefix_blocks_read_locally
    computed = after.num_prefill_tokens_computed - before.num_prefill_tokens_computed
    print(f"\nhit TTFT {ttft_ms:.1f} ms: {loaded} tokens loaded ({local} blocks read locally), ", end="")
    print(f"{computed} computed")
    for name, spans in SPANS.by_name.items():
        first, last = spans[0][0] * 1e3, spans[-1][1] * 1e3
        total = f"{SPANS.total_ms(name):8.1f} ms in {len(spans):4d} calls"
        calls = ", ".join(f"{b * 1e3:.0f}-{e * 1e3:.0f}" for b, e in spans[:3])
        more = ", ..." if len(spans) > 3 else ""
        print(f"  {name:44s} {total}, {first:7.1f} -> {last:7.1f} (calls {calls}{more})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefix", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--paths", nargs="+", default=["stream", "local"], choices=("stream", "local"),
        help="how hits load their prefix: the GetBlocks stream, same-host reads, or each in turn",
    )  # fmt: skip
    parser.add_argument("--kv-mb", type=int, default=1024)
    parser.add_argument("--redis-server", type=Path, default=None)
    parser.add_argument(
        "--store-env", action="append", default=[], metavar="NAME=VALUE",
        help="an environment variable for the kvstore process (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--cold", action="append", default=[], metavar="FIELD=VALUE",
        help="a ColdTierConfig field for the engines (repeatable; true/false/ints)",
    )  # fmt: skip
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.prefix = args.prefix or shape.prefix_tokens
    args.dtype = shape.dtype
    args.max_prefill_tokens = shape.max_prefill_tokens
    args.max_seq_len = 8192 if shape.hf_config is None else args.prefix + 32
    args.gpu_memory_utilization = 0.9
    args.deadline_ms, args.transfer_deadline_ms = 60_000, 600_000
    args.local_reads = False  # each hit sets its own path (--paths)
    args.store_env = dict(item.split("=", 1) for item in args.store_env)
    args.cold_overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in args.cold)}
    return args


def _value(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.lstrip("-").isdigit() else text


if __name__ == "__main__":
    run(parse_args())
