"""Overlapped steps (`LLMEngine.overlap`): a decode step launched on the last step's sampled ids before
the host syncs on them. On the CPU the launch runs at once, but the path is the same one CUDA graphs
take: the ids never leave the device, and the last step is committed after the next one launched."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.env import EnvError
from services.engine.config import EngineConfig
from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector
from tests.engine.mixed_workload import CANCEL, PLAN, mixed_run


def test_overlapped_steps_equal_plain_ones_under_joins_cancels_preemption_and_tiers(
    stories_hf_dir: Path,
) -> None:
    plain = mixed_run(stories_hf_dir, "cpu", graphs=False, overlap=False)
    overlapped = mixed_run(stories_hf_dir, "cpu", graphs=False, overlap=True)
    assert plain.overlapped == 0 and overlapped.overlapped > 100
    assert plain.preemptions >= 1 and overlapped.preemptions == plain.preemptions
    cancelled = plain.outputs[CANCEL[1]]
    assert 0 < len(cancelled) < 90  # cancelled mid-decode
    assert overlapped.outputs == plain.outputs


def test_overlap_setting_is_auto_unless_forced() -> None:
    assert EngineConfig.from_env({}).overlap is None
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "auto"}).overlap is None
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "true"}).overlap is True
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "off"}).overlap is False
    with pytest.raises(EnvError, match="THERMOCLINE_ENGINE_OVERLAP"):
        EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "sometimes"})


def test_a_preempted_row_whose_last_token_was_in_flight_is_not_run_again(stories_hf_dir: Path) -> None:
    """The batch request preempted in the mixed workload is given exactly as many tokens as it holds
    when preempted plus the one in flight: that token ends it while it waits to be admitted again,
    and it must leave the queue then (it used to be admitted again and run one token past its limit)."""
    plan = [(s, n, 58 if n == 120 else new, c, e) for s, n, new, c, e in PLAN]
    for overlap in (False, True):
        run = mixed_run(stories_hf_dir, "cpu", graphs=False, overlap=overlap, plan=plan)
        assert run.preemptions >= 1
        assert len(run.outputs[2]) == 58, overlap


def test_a_row_readmitted_with_its_last_prompt_token_left_reads_that_token_not_the_sampled_one(
    stories_hf_dir: Path,
) -> None:
    """S samples its first token in its last prefill chunk; scheduling the next step, a mid-prompt
    request preempts S and S is admitted again at once with its prompt's last token left (the rest
    from the prefix cache). That one-token prefill row must read the prompt token, not the sampled
    one in flight (an overlapped launch did), or S's next tokens change."""

    def run(overlap: bool) -> list[tuple[int, ...]]:
        kv = KVCacheSpec(block_size=16, num_hot_blocks=1 + 12)
        engine = LLMEngine.load(
            stories_hf_dir, device="cpu", dtype="float32", max_batch_size=4, max_seq_len=512, kv=kv,
            max_prefill_tokens=48, progress=False, overlap=overlap,
        )  # fmt: skip
        rng = random.Random(0)
        prompts = [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in (60, 150, 17)]
        collectors = [ResultCollector(p) for p in prompts]
        engine.submit(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True), collectors[0],
                      intent_class="critical")  # fmt: skip
        waiting = engine.submit(prompts[1], SamplingParams(max_new_tokens=5, ignore_eos=True), collectors[1])
        engine.submit(prompts[2], SamplingParams(max_new_tokens=12, ignore_eos=True), collectors[2],
                      intent_class="batch")  # fmt: skip
        for _ in range(300):
            engine.step()
            if engine.stats().num_preemptions >= 1 and waiting is not None:
                engine.cancel(waiting)  # S is not preempted again: the bad token would stay
                waiting = None
            if all(c.done.is_set() for c in collectors):
                break
        engine.stop()
        assert engine.stats().num_preemptions >= 1
        return [collectors[i].result().token_ids for i in (0, 2)]

    assert run(overlap=True) == run(overlap=False)
