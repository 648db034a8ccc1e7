"""The same engine code on CUDA (skipped without a GPU): fp32 golden output, bf16 close to transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT_IDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("fixture", ["stories_hf_dir", "stories_gguf"])
def test_fp32_golden_on_cuda(fixture: str, request: pytest.FixtureRequest) -> None:
    engine = LLMEngine.load(request.getfixturevalue(fixture), device="cuda", dtype="float32", progress=False)
    results = engine.generate([[1, 450, 1], STORIES_PROMPT_IDS], SamplingParams(max_new_tokens=40))
    assert list(results[1].token_ids) == STORIES_GOLDEN_IDS


def test_auto_dtype_is_bf16_and_close_to_transformers(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine.load(tiny_dir, device="auto", max_batch_size=4, max_seq_len=128, progress=False)
    assert engine.runner.device.type == "cuda"
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = list(range(5, 40))
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    result = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    assert result.token_ids[0] == int(reference.argmax())
    batched = engine.generate([prompt, [7, 8, 9]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(batched[0].token_ids) == 8


def test_seeded_sampling_on_cuda(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cuda", max_batch_size=2, max_seq_len=64, progress=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    first = engine.generate([[3, 4, 5]], params)[0].token_ids
    assert engine.generate([[3, 4, 5]], params)[0].token_ids == first
