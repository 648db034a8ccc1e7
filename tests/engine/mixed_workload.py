"""A continuous-batching workload that exercises most of the engine's step loop at once: requests join
and leave mid-decode, one is cancelled, one may end on EOS, a critical one preempts, and the tiers
demote throughout. Tests run it under different engine settings and compare the greedy outputs."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector

# Tiers small enough that stories260K's 512 positions cross sink, warm and hot; a hot pool small enough
# that the critical request preempts a batch one mid-decode.
MIXED_KV = KVCacheSpec(
    block_size=16,
    num_hot_blocks=1 + 24,
    num_warm_groups=64,
    tiers=TierConfig(enabled=True, sink_tokens=4, hot_tokens=48, warm_tokens=4096, group_size=32),
)

PLAN = [  # (step to submit at, prompt length, new tokens, class, ignore EOS)
    (0, 40, 200, "batch", True), (0, 7, 60, "standard", True), (0, 120, 150, "batch", True),
    (30, 25, 90, "standard", True), (45, 60, 120, "critical", True), (80, 5, 40, "interactive", True),
    (90, 12, 80, "standard", False),
]  # fmt: skip
CANCEL = (110, 3)  # at this step, cancel the request submitted at this index in PLAN


class MixedRun(NamedTuple):
    outputs: list[tuple[int, ...]]  # each request's tokens (the cancelled one's up to its cancel)
    preemptions: int
    replays: int  # decode steps served by a CUDA graph
    overlapped: int  # steps launched before the last one's sync


def mixed_run(
    path: Path, device: str, graphs: bool, overlap: bool | None = None, plan: list[tuple] | None = None
) -> MixedRun:
    engine = LLMEngine.load(
        path, device=device, dtype="float32", max_batch_size=6, max_seq_len=512, kv=MIXED_KV,
        cuda_graphs=graphs, progress=False, overlap=overlap,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    collectors, handles = [], []
    step = 0
    pending = list(PLAN if plan is None else plan)
    while pending or not all(c.done.is_set() for c in collectors):
        while pending and pending[0][0] <= step:
            _, length, new, cls, ignore_eos = pending.pop(0)
            prompt = torch.randint(1, 512, (length,), generator=generator).tolist()
            collectors.append(ResultCollector(prompt))
            params = SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos)
            handles.append(engine.submit(prompt, params, collectors[-1], intent_class=cls))
        if step == CANCEL[0]:
            engine.cancel(handles[CANCEL[1]])
        engine.step()
        step += 1
    results = [c.result() for c in collectors]
    assert all(r.error is None for r in results), [r.error for r in results]
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    run = MixedRun(
        [r.token_ids for r in results], engine.stats().num_preemptions, replays, engine._num_overlapped_steps
    )
    engine.stop()
    return run
