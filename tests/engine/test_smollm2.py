"""SmolLM2-135M-Instruct Q4_1 GGUF (real model, ~100 MB, fetched once): parity with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import FinishReason

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(smollm_gguf: Path) -> Any:
    """transformers' own GGUF loader (it dequantizes with the same gguf package) as the reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_single_and_batched(smollm_engine: LLMEngine, hf_model: Any) -> None:
    prompts = [smollm_engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [_hf_greedy(hf_model, p) for p in prompts]
    assert [list(smollm_engine.generate([p], params)[0].token_ids) for p in prompts[:1]] == expected[:1]
    assert [list(r.token_ids) for r in smollm_engine.generate(prompts, params)] == expected


def test_logits_match_transformers(smollm_engine: LLMEngine, hf_model: Any) -> None:
    from services.engine.kv.block_table import BlockTable
    from services.engine.kv.tiers import TierConfig
    from tests.engine.paged_helpers import forward, make_cache

    model = smollm_engine.runner.model
    ids = torch.tensor([smollm_engine.tokenizer.encode(PROMPTS[0])])
    hidden = forward(model, make_cache(model.config), [BlockTable(TierConfig())], ids, 0)
    with torch.inference_mode():
        ours = model.compute_logits(hidden)
        theirs = hf_model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_chat_answer_names_paris(smollm_engine: LLMEngine) -> None:
    tokenizer = smollm_engine.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat.endswith("<|im_start|>assistant\n")
    prompt = tokenizer.encode(chat)
    assert prompt[0] == tokenizer.backend.token_to_id("<|im_start|>")  # no BOS: SmolLM2 adds none
    result = smollm_engine.generate([prompt], SamplingParams(max_new_tokens=40))[0]
    assert "Paris" in result.text
    assert result.finish_reason is FinishReason.STOP  # ended on <|im_end|>
    assert result.token_ids[-1] in tokenizer.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_requests_joining_and_leaving_mid_decode_match_transformers(
    smollm_engine: LLMEngine, hf_model: Any
) -> None:
    from services.engine.serving.generation_result import ResultCollector

    prompts = [smollm_engine.tokenizer.encode(p) for p in PROMPTS]
    expected = [_hf_greedy(hf_model, p) for p in prompts]
    lengths = (NEW_TOKENS, 8, 16)  # the second leaves early, the third mid-way
    collectors = [ResultCollector(p) for p in prompts]
    smollm_engine.submit(
        prompts[0], SamplingParams(max_new_tokens=lengths[0], ignore_eos=True), collectors[0]
    )
    for _ in range(4):  # prefill + 3 decode steps of the first alone
        smollm_engine.step()
    for i in (1, 2):
        smollm_engine.submit(
            prompts[i], SamplingParams(max_new_tokens=lengths[i], ignore_eos=True), collectors[i]
        )
    while not all(c.done.is_set() for c in collectors):
        smollm_engine.step()
    got = [list(c.result().token_ids) for c in collectors]
    assert got == [e[:n] for e, n in zip(expected, lengths, strict=True)]
