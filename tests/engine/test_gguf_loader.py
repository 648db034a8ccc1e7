"""GGUF loading: Q/K un-permutation, metadata -> config, and the embedded tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from tokenizers import Tokenizer as BackendTokenizer

from services.engine.checkpoint import open_checkpoint
from services.engine.gguf_loader import GGUFMetadata, gguf_model_config, our_name, unpermute_rope
from services.engine.model_config import UnsupportedModel

TEXTS = [
    "Once upon a time",
    "Hello world!\n  Two  spaces, ünïcödé 🙂 and 123.",
    "Lily's dog\tjumped over the log.",
]


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # what llama.cpp's converter does to HF q/k weights (rotate-half -> interleaved pairs)
    out_features, in_features = weight.shape
    return (
        weight.reshape(num_heads, 2, out_features // num_heads // 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 8])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    weight = torch.randn(num_heads * 16, 24)
    restored = unpermute_rope(_llama_cpp_permute(weight, num_heads), num_heads)
    assert torch.equal(restored, weight)
    assert not torch.equal(_llama_cpp_permute(weight, num_heads), weight)


def test_tensor_names_map_to_ours() -> None:
    assert our_name("token_embd.weight") == "embed_tokens.weight"
    assert our_name("blk.12.attn_k.weight") == "layers.12.self_attn.k_proj.weight"
    assert our_name("blk.0.ffn_down.weight") == "layers.0.mlp.down_proj.weight"
    with pytest.raises(UnsupportedModel, match="unexpected GGUF tensor"):
        our_name("blk.0.attn_qkv.weight")


def test_stories_config_from_metadata(stories_gguf: Path) -> None:
    meta = GGUFMetadata(GGUFReader(str(stories_gguf)))
    config = gguf_model_config(meta)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 5, 8, 4)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (8, 172, 512)
    assert config.rope_theta == 10000.0  # no freq_base key in this file: the default applies
    assert not config.tie_word_embeddings  # it stores output.weight
    assert meta.token_id("padding_token_id") is None  # stored as 0xFFFFFFFF
    assert meta.token_id("seperator_token_id") is None


def test_stories_weights_equal_the_reference_conversion(stories_gguf: Path, stories_hf_dir: Path) -> None:
    from_gguf = dict(open_checkpoint(stories_gguf).tensors())
    from_hf = dict(open_checkpoint(stories_hf_dir).tensors())
    assert from_gguf.keys() == from_hf.keys()
    for name, tensor in from_hf.items():
        assert torch.equal(from_gguf[name], tensor), name


def test_sentencepiece_tokenizer_matches_reference_json(stories_gguf: Path, stories_hf_dir: Path) -> None:
    ours = open_checkpoint(stories_gguf).tokenizer
    reference = BackendTokenizer.from_file(str(stories_hf_dir / "tokenizer.json"))
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos_by_default) == (1, (2,), True)
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=True).ids
        assert ours.encode(text) == ids
        assert ours.decode(ids) == reference.decode(ids)
