"""Preemption when hot blocks run short: the lowest class yields by recompute, and nothing is lost."""

from __future__ import annotations

from pathlib import Path

from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import FinishReason, LLMEngine, SamplingParams
from services.engine.serving.generation_result import GenerationResult, ResultCollector

LOW = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
HIGH = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)


def _engine(path: Path, num_hot_blocks: int = 0) -> LLMEngine:
    kv = KVCacheSpec(block_size=16, num_hot_blocks=num_hot_blocks)
    return LLMEngine.load(path, device="cpu", max_batch_size=4, max_seq_len=256, kv=kv, progress=False)


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> GenerationResult:
    return engine.generate([prompt], params)[0]


def test_a_critical_request_preempts_a_batch_one_which_still_finishes_with_the_same_tokens(
    tiny_dir: Path,
) -> None:
    low_prompt, high_prompt = list(range(5, 35)), list(range(40, 70))
    roomy = _engine(tiny_dir)
    expected_low, expected_high = _alone(roomy, low_prompt, LOW), _alone(roomy, high_prompt, HIGH)
    tight = _engine(tiny_dir, num_hot_blocks=1 + 6)  # 96 tokens: 80 for `batch` + 60 for `critical` won't fit
    low, high = ResultCollector(low_prompt), ResultCollector(high_prompt)
    tight.submit(low_prompt, LOW, low, intent_class="batch")
    for _ in range(10):  # prefill and a few decode steps: `batch` holds 3 of the 6 blocks
        tight.step()
    tight.submit(high_prompt, HIGH, high, intent_class="critical")
    while not (low.done.is_set() and high.done.is_set()):
        tight.step()
    assert tight.stats().num_preemptions >= 1
    assert high.result().finish_reason is FinishReason.LENGTH
    assert high.result().token_ids == expected_high.token_ids
    assert low.result().finish_reason is FinishReason.LENGTH  # preempted, recomputed, finished
    assert low.result().token_ids == expected_low.token_ids
    assert tight.runner.kv_cache.hot.pool.num_used_blocks() == 0
