"""bench/lm_blocks.py: our forward of a Llama's first blocks against transformers' own, LoRA
factors folded into the weights, and bench/safety_lm_finetune.py's GGUF dequantizers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.lm_blocks import LlamaBlocks, padded, pooled, read_gguf_blocks
from tests.engine.conftest import STORIES_DIR


@pytest.fixture(scope="module")
def stories_gguf() -> Path:
    path = STORIES_DIR / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"stories260K GGUF not found at {path}")
    return path


@pytest.mark.parametrize("num_blocks", [1, 3])
def test_our_blocks_match_transformers_llama_on_the_same_gguf(stories_gguf: Path, num_blocks: int) -> None:
    """stories260K (a trained Llama) read from its GGUF file: after `num_blocks` blocks our
    residual stream equals transformers' hidden state on the model's safetensors copy, for
    right-padded rows of two lengths."""
    from transformers import AutoModelForCausalLM

    shape, tensors, _ = read_gguf_blocks(stories_gguf, num_blocks)
    ours = LlamaBlocks(shape, tensors, num_blocks)
    reference = AutoModelForCausalLM.from_pretrained(STORIES_DIR / "hf")  # the same weights
    reference.eval()
    rows = [[1, 5, 9, 23, 42, 7, 300, 11], [1, 17, 4]]
    ids, lengths = padded(rows)
    with torch.no_grad():
        got = ours(ids)
        for j, row in enumerate(rows):
            want = reference.model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(got[j, : len(row)], want[num_blocks][0], atol=1e-4, rtol=1e-4)
    last = pooled(got, lengths, torch.ones(shape.hidden))
    assert last.shape == (2, shape.hidden) and torch.isfinite(last).all()


def test_merged_lora_factors_equal_the_factors_applied_on_the_fly(stories_gguf: Path) -> None:
    """Training applies the factors beside the frozen weights; serving folds them in: same states."""
    shape, tensors, _ = read_gguf_blocks(stories_gguf, 2)
    training = LlamaBlocks(shape, tensors, 2, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, factor in training.lora.items():
            if name.endswith("_b"):
                factor.copy_(torch.randn_like(factor) * 0.05)
    serving = LlamaBlocks(shape, tensors, 2)
    serving.merge(training.lora_tensors(), rank=4, alpha=8.0)
    ids, _ = padded([[1, 5, 9, 23, 42]])
    with torch.no_grad():
        changed = training(ids)
        torch.testing.assert_close(serving(ids), changed, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(LlamaBlocks(shape, tensors, 2)(ids), changed, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F32"])
def test_the_benchs_dequantizers_match_gguf(qtype: str) -> None:
    """The GPU run rebuilds the trunk from raw GGUF blocks without the gguf package."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from bench.safety_lm_finetune import dequantize as ours

    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    raw = quantize(values, kind)
    torch.testing.assert_close(
        ours(raw, int(kind), (6, 64)), torch.from_numpy(dequantize(raw, kind).reshape(6, 64))
    )
