"""GGUF loading: Q/K un-permutation, metadata -> config, and the embedded tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from tokenizers import Tokenizer as BackendTokenizer

from services.engine.model.config import UnsupportedModel
from services.engine.model.gguf.loader import gguf_model_config, our_name, unpermute_rope
from services.engine.model.gguf.metadata import GGUFMetadata
from services.engine.model.loader import open_checkpoint
from tests.engine.tiny_gguf import hf_to_gguf, llama_cpp_permute

TEXTS = [
    "Once upon a time",
    "Hello world!\n  Two  spaces, ünïcödé 🙂 and 123.",
    "Lily's dog\tjumped over the log.",
]


@pytest.mark.parametrize("num_heads", [1, 3, 8])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    weight = torch.randn(num_heads * 16, 24)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
    assert torch.equal(unpermute_rope(permuted, num_heads), weight)
    assert not torch.equal(permuted, weight)


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


@pytest.fixture(scope="module", params=["tiny_dir", "tiny_tied_sharded_dir"])
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, dict]:
    """A tiny HF Llama written as a llama.cpp-style GGUF; also the weights the GGUF should reproduce."""
    hf_dir: Path = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("gguf") / f"{hf_dir.name}.gguf"
    return hf_dir, out, hf_to_gguf(hf_dir, out)


def test_quantized_gguf_matches_transformers_on_the_same_weights(tiny_gguf: tuple[Path, Path, dict]) -> None:
    from transformers import AutoModelForCausalLM

    from services.engine.llm_engine import LLMEngine
    from services.engine.scheduling.sampling_params import SamplingParams

    hf_dir, gguf_path, expected_weights = tiny_gguf
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference.load_state_dict(expected_weights, strict=False)  # F16/Q8_0/Q4_1 round-tripped weights
    engine = LLMEngine.load(gguf_path, device="cpu", max_batch_size=2, max_seq_len=128, progress=False)
    prompts = [[0, 17, 99, 5, 240, 31], [0, 64]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])  # starts with id 0: pass the mask, or HF takes it for padding
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, eos_token_id=None
        )
        assert list(result.token_ids) == out[0, len(prompt) :].tolist()


def test_byte_level_tokenizer_from_gguf_matches_tokenizer_json(tiny_gguf: tuple[Path, Path, dict]) -> None:
    from services.engine.text.tokenizer import Tokenizer

    hf_dir, gguf_path, _ = tiny_gguf
    ours = open_checkpoint(gguf_path).tokenizer
    reference = Tokenizer.from_hf_dir(hf_dir)
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, reference.eos_token_ids)
    for text in [*TEXTS, "<|user|>hi<|assistant|>"]:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)


def test_llama3_rope_survives_as_rope_freqs(tiny_gguf: tuple[Path, Path, dict]) -> None:
    hf_dir, gguf_path, _ = tiny_gguf
    from_hf = open_checkpoint(hf_dir).config
    from_gguf = open_checkpoint(gguf_path).config
    expected_type = "freq_factors" if from_hf.rope_scaling.rope_type == "llama3" else "default"
    assert from_gguf.rope_scaling.rope_type == expected_type
    assert from_gguf.tie_word_embeddings == from_hf.tie_word_embeddings
