"""The same engine code on CUDA (skipped without a GPU): fp32 golden output, bf16 close to transformers."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT_IDS
from tests.engine.mixed_workload import MIXED_KV, mixed_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_tf32_and_free_memory_after() -> Iterator[None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    gc.collect()  # an engine sized from free memory must not see the last test's pools as in use
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fixture", ["stories_hf_dir", "stories_gguf"])
def test_fp32_golden_on_cuda(fixture: str, request: pytest.FixtureRequest) -> None:
    engine = LLMEngine.load(request.getfixturevalue(fixture), device="cuda", dtype="float32", progress=False)
    results = engine.generate([[1, 450, 1], STORIES_PROMPT_IDS], SamplingParams(max_new_tokens=40))
    assert list(results[1].token_ids) == STORIES_GOLDEN_IDS


def test_auto_dtype_is_bf16_and_close_to_transformers(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine.load(
        tiny_dir,
        device="auto",
        max_batch_size=4,
        max_seq_len=128,
        kv=KVCacheSpec(num_hot_blocks=64),
        progress=False,
    )
    assert engine.runner.device.type == "cuda"
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = list(range(5, 40))
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    result = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    # bf16 roundings differ between the two (fused kernels, another attention order): the token must be
    # one transformers ranks within a bf16 step of its best, not necessarily its argmax
    assert reference[result.token_ids[0]] >= reference.max() - 2**-7 * reference.abs().max()
    batched = engine.generate([prompt, [7, 8, 9]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(batched[0].token_ids) == 8


def test_seeded_sampling_on_cuda(tiny_dir: Path) -> None:
    kv = KVCacheSpec(num_hot_blocks=16)
    engine = LLMEngine.load(tiny_dir, device="cuda", max_batch_size=2, max_seq_len=64, kv=kv, progress=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    first = engine.generate([[3, 4, 5]], params)[0].token_ids
    assert engine.generate([[3, 4, 5]], params)[0].token_ids == first


def test_kv_pools_sized_from_gpu_memory_stay_inside_the_utilization(stories_hf_dir: Path) -> None:
    """The setting bounds the whole device's memory in use, as the engine reads it: run this test with
    the GPU to itself: other processes' allocations (tools/split_tests.sh's parts, side by side) move
    both of its readings."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free) / total + 0.10  # what this process already holds, plus a tenth
    kv = KVCacheSpec(gpu_memory_utilization=utilization)
    engine = LLMEngine.load(
        stories_hf_dir, device="cuda", dtype="float32", max_batch_size=8, kv=kv, progress=False
    )
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    assert all(r.error is None for r in engine.generate([STORIES_PROMPT_IDS] * 8, params))
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= utilization * total  # weights, pools, graphs and a step's activations
    plan = engine.capacity
    assert plan is not None and plan.kv_bytes > 0.05 * total  # most of the tenth became KV blocks
    assert engine.max_seq_len == engine.config.max_position_embeddings
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_graphs_on_equal_graphs_off_and_the_cpu_under_joins_preemption_and_tiers(
    stories_hf_dir: Path,
) -> None:
    cpu = mixed_run(stories_hf_dir, "cpu", graphs=False)
    eager = mixed_run(stories_hf_dir, "cuda", graphs=False)
    graphs = mixed_run(stories_hf_dir, "cuda", graphs=True)  # overlapped steps too: on with graphs
    assert cpu.preemptions >= 1 and eager.replays == 0 and graphs.replays > 100
    assert graphs.overlapped > 100 and eager.overlapped == 0
    assert eager.outputs == cpu.outputs
    assert graphs.outputs == cpu.outputs


def probed_masses(path: Path, graphs: bool) -> tuple[list[float], int, int]:
    """(hot mass of each probe, decode steps, decode steps a graph replayed) of two 150-token decodes."""
    engine = LLMEngine.load(
        path, device="cuda", dtype="float32", max_batch_size=2, max_seq_len=512, kv=MIXED_KV,
        cuda_graphs=graphs, progress=False,
    )  # fmt: skip
    prompts = [list(range(3, 203)), list(range(7, 127))]
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        engine.submit(prompt, SamplingParams(max_new_tokens=150, ignore_eos=True), collector)
    masses = []
    while not all(c.done.is_set() for c in collectors):
        probes = engine.runner._num_probes
        engine.step()
        if engine.runner._num_probes > probes:
            masses.append(engine._hot_attention_mass)
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    decode_steps = engine._num_decode_steps  # counted as each decode step is prepared (tiers on)
    engine.stop()
    return masses, decode_steps, replays


def test_a_probed_step_replays_its_graph_and_measures_what_the_eager_step_does(stories_hf_dir: Path) -> None:
    eager, _, no_replays = probed_masses(stories_hf_dir, graphs=False)
    replayed, decode_steps, replays = probed_masses(stories_hf_dir, graphs=True)
    assert len(eager) >= 2 and no_replays == 0
    assert replays == decode_steps  # probed steps replay too
    assert replayed == pytest.approx(eager, abs=1e-4)
