"""Host CPU time of an engine decode step at a large batch, the model's forward left out (CPU only).

    .venv/bin/python bench/host_step_cpu.py --tiers on                  # this tree
    .venv/bin/python bench/host_step_cpu.py --tiers on --repo ../base   # another checkout, to compare

On a GPU at batch 256 the 1B decode step waits for the host: the per-row Python of a step (commit,
text, scheduling, the step's tables) outlasts the device's few milliseconds. This measures that work
on the CPU with stories260K, whose forward is tiny: `time.thread_time` of each `LLMEngine.step`, less
the time inside the model's forward and the warm-tier copies (device work on a GPU). Thread time,
not wall time, so that other load on the machine moves it less; run the two trees interleaved for a
comparison. Prints one line; writes nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tiers", choices=("on", "off"), default="on")
    parser.add_argument("--prompt-tokens", type=int, default=160, help="past the 132-token sink + hot window")
    parser.add_argument("--new-tokens", type=int, default=97)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    sys.path.insert(0, str(args.repo / "protos"))

    import torch

    from services.engine.kv.tiers import KVCacheSpec, TierConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.model.registry import resolve_model
    from services.engine.scheduling.sampling_params import SamplingParams

    torch.set_num_threads(1)
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=40_000, group_size=32)
    engine = LLMEngine.load(
        resolve_model("stories260K"), device="cpu", dtype="float32", max_batch_size=args.batch,
        max_seq_len=args.prompt_tokens + args.new_tokens + 8, progress=False,
        kv=KVCacheSpec(tiers=tiers) if args.tiers == "on" else KVCacheSpec(),
    )  # fmt: skip
    prompts = [
        [1] + [(row * 7 + i) % 500 + 2 for i in range(args.prompt_tokens - 1)] for row in range(args.batch)
    ]
    engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    device_work = [0.0]

    def excluded(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                device_work[0] += time.thread_time() - started

        return wrapper

    engine.runner.model.forward = excluded(engine.runner.model.forward)  # type: ignore[method-assign]
    engine.runner.kv_cache.copy_to_warm = excluded(engine.runner.kv_cache.copy_to_warm)  # type: ignore[method-assign]
    step = engine.step
    step_ms: list[float] = []

    def timed_step() -> None:
        started, before = time.thread_time(), device_work[0]
        step()
        step_ms.append((time.thread_time() - started - (device_work[0] - before)) * 1e3)

    engine.step = timed_step  # type: ignore[method-assign]
    gc.collect()
    engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
    engine.stop()
    decode = step_ms[1:-1]  # the first step prefills, the last one only ends the requests
    median = statistics.median(decode)
    print(
        f"{args.repo.name}, batch {args.batch}, tiers {args.tiers}: host CPU ms per decode step "
        f"p50 {median:.2f}, mean {statistics.mean(decode):.2f}, max {max(decode):.2f} "
        f"({median * 1e3 / args.batch:.1f} µs a row)"
    )


if __name__ == "__main__":
    main()
