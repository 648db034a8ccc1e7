"""Our Llama forward pass against transformers' on the same tiny random checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.kv.block_table import BlockTable
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig, RopeScaling, UnsupportedModel
from services.engine.model.llama import LlamaModel
from services.engine.model.loader import load_model, open_checkpoint
from services.engine.model.rotary import inverse_frequencies
from tests.engine.paged_helpers import CPU, forward, make_cache


def _load_pair(path: Path) -> tuple[LlamaModel, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    ours = load_model(open_checkpoint(path), CPU, torch.float32, max_positions=512, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, theirs


def _full_forward(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    cache = make_cache(model.config)
    tables = [BlockTable(TierConfig()) for _ in range(ids.shape[0])]
    return forward(model, cache, tables, ids, 0)  # [B, S, E]


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_tied_sharded_dir"])
def test_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    ours, theirs = _load_pair(request.getfixturevalue(fixture))
    ids = torch.randint(0, ours.config.vocab_size, (3, 150), generator=torch.Generator().manual_seed(0))
    hidden = _full_forward(ours, ids)
    with torch.inference_mode():
        reference = theirs(ids, output_hidden_states=True)
    torch.testing.assert_close(ours.compute_logits(hidden), reference.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, reference.hidden_states[-1], atol=1e-5, rtol=1e-5)


def test_tied_checkpoint_shares_embedding(tiny_tied_sharded_dir: Path) -> None:
    assert len(list(tiny_tied_sharded_dir.glob("model-*-of-*.safetensors"))) > 1
    model = load_model(open_checkpoint(tiny_tied_sharded_dir), CPU, torch.float32, 64, progress=False)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_cached_decode_matches_full_forward(tiny_dir: Path) -> None:
    model = load_model(open_checkpoint(tiny_dir), CPU, torch.float32, 512, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    full = _full_forward(model, ids)
    cache, tables = make_cache(model.config, block_size=4), [BlockTable(TierConfig())]
    forward(model, cache, tables, ids[:, :30], 0)
    steps = [forward(model, cache, tables, ids[:, t : t + 1], t) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 30:], atol=1e-5, rtol=1e-5)


def test_llama3_inverse_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, scaling), expected)


def test_config_rejects_unsupported_architectures() -> None:
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}  # fmt: skip
    assert ModelConfig.from_hf_config(base).num_kv_heads == 2
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'"):
        ModelConfig.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModel, match="attention_bias"):
        ModelConfig.from_hf_config({**base, "attention_bias": True})
    with pytest.raises(UnsupportedModel, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_config({**base, "num_key_value_heads": 3})
    with pytest.raises(UnsupportedModel, match="rope type 'yarn'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
