"""stories260K (trained, tiny): HF dir and the original GGUF both give the golden greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine, StreamEvent
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import FinishReason
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_GOLDEN_TEXT, STORIES_PROMPT, STORIES_PROMPT_IDS


@pytest.mark.parametrize("fixture", ["stories_hf_dir", "stories_gguf"])
def test_golden_greedy_continuation(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    engine = LLMEngine.load(path, device="cpu", max_batch_size=3, progress=False)
    prompt_ids = engine.tokenizer.encode(STORIES_PROMPT)
    assert prompt_ids == STORIES_PROMPT_IDS  # BOS added by this model's convention
    result = engine.generate([prompt_ids], SamplingParams(max_new_tokens=40))[0]
    assert 2 not in STORIES_GOLDEN_IDS  # no early EOS in the golden run, so all 40 tokens are compared
    assert list(result.token_ids) == STORIES_GOLDEN_IDS
    assert result.finish_reason is FinishReason.LENGTH
    assert engine.tokenizer.decode(STORIES_PROMPT_IDS + STORIES_GOLDEN_IDS) == STORIES_GOLDEN_TEXT
    assert STORIES_PROMPT + result.text == STORIES_GOLDEN_TEXT


def test_golden_output_survives_batching(stories_gguf: Path) -> None:
    engine = LLMEngine.load(stories_gguf, device="cpu", max_batch_size=3, progress=False)
    others = [engine.tokenizer.encode(t) for t in ("Tom had a dog", "The sun")]
    results = engine.generate([others[0], STORIES_PROMPT_IDS, others[1]], SamplingParams(max_new_tokens=40))
    assert list(results[1].token_ids) == STORIES_GOLDEN_IDS


def test_without_chat_template_apply_fails_clearly(stories_hf_dir: Path) -> None:
    from services.engine.text.chat_template import ChatTemplateError

    engine = LLMEngine.load(stories_hf_dir, device="cpu", max_batch_size=1, progress=False)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_golden_holds_with_tiers_on_and_hot_tokens_128(stories_hf_dir: Path) -> None:
    """400 tokens, so positions past sink + 128 hot really are served from INT4 warm groups."""
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=4096, group_size=32)
    tiered = LLMEngine.load(
        stories_hf_dir, device="cpu", max_batch_size=2, progress=False, kv=KVCacheSpec(tiers=tiers)
    )
    plain = LLMEngine.load(stories_hf_dir, device="cpu", max_batch_size=2, progress=False)
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    events: list[StreamEvent] = []
    tiered.submit(STORIES_PROMPT_IDS, params, events.append)
    peak_warm_tokens = 0
    while not (events and events[-1].finished):
        tiered.step()
        peak_warm_tokens = max(peak_warm_tokens, tiered.stats().num_warm_tokens)
    tokens = [t for e in events for t in e.token_ids]
    assert tokens[:40] == STORIES_GOLDEN_IDS
    assert peak_warm_tokens >= 400 - 128 - 32 - 32  # all but sink, hot window and the unfilled group
    usage = events[-1].usage
    assert usage is not None and usage.warm_tokens > 0
    # measured: the whole 400-token continuation equals the untiered one on this model
    assert tokens == list(plain.generate([STORIES_PROMPT_IDS], params)[0].token_ids)
    assert tiered.stats().num_warm_tokens == 0 and tiered.stats().num_hot_tokens == 0  # all freed
