"""llama.cpp GGUF files: metadata -> ModelConfig, tensors -> dequantized weights in our layout."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from services.engine.model.checkpoint import Checkpoint
from services.engine.model.config import ModelConfig, RopeScaling, UnsupportedModel
from services.engine.model.gguf.metadata import GGUFMetadata
from services.engine.model.gguf.tokenizer import build_gguf_tokenizer

ROPE_FREQS = "rope_freqs.weight"

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def open_gguf(path: Path) -> Checkpoint:
    """Read a GGUF file's config and tokenizer; weights are dequantized lazily while loading."""
    reader = GGUFReader(str(path))
    meta = GGUFMetadata(reader)
    config = gguf_model_config(meta)
    weights = [t for t in reader.tensors if t.name != ROPE_FREQS]
    return Checkpoint(
        model_id=path.stem,
        config=config,
        tokenizer=build_gguf_tokenizer(meta),
        tensors=lambda: iter_gguf_tensors(weights, config),
        num_tensors=len(weights),
    )


def gguf_model_config(meta: GGUFMetadata) -> ModelConfig:
    """Build a ModelConfig from `llama.*` metadata (rope theta defaults to 10000 when absent)."""
    if meta.arch != "llama":
        raise UnsupportedModel(f"GGUF architecture {meta.arch!r} is not supported; this engine runs 'llama'")
    hidden = int(meta.arch_get("embedding_length"))
    num_heads = int(meta.arch_get("attention.head_count"))
    head_dim = int(meta.arch_get("attention.key_length", hidden // num_heads))
    rope_dims = int(meta.arch_get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedModel(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    names = {t.name for t in meta.reader.tensors}
    return ModelConfig(
        vocab_size=_vocab_size(meta),
        hidden_size=hidden,
        intermediate_size=int(meta.arch_get("feed_forward_length")),
        num_layers=int(meta.arch_get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.arch_get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta),
        max_position_embeddings=int(meta.arch_get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
    )


def _vocab_size(meta: GGUFMetadata) -> int:
    size = meta.arch_get("vocab_size")
    if size is not None:
        return int(size)
    embed = next(t for t in meta.reader.tensors if t.name == "token_embd.weight")
    return int(embed.shape[-1])  # ggml order: [hidden, vocab]


def _rope_scaling(meta: GGUFMetadata) -> RopeScaling:
    freqs = next((t for t in meta.reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:  # llama3-style scaling, stored precomputed as per-dim divisors
        return RopeScaling(rope_type="freq_factors", freq_factors=tuple(float(x) for x in _to_numpy(freqs)))
    kind = str(meta.arch_get("rope.scaling.type", "none"))
    if kind in ("none", ""):
        return RopeScaling()
    if kind != "linear":
        raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported (none, linear, rope_freqs)")
    return RopeScaling(rope_type="linear", factor=float(meta.arch_get("rope.scaling.factor", 1.0)))


def iter_gguf_tensors(tensors: list[Any], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, fp32 tensor `[out, in]`), dequantized and with Q/K un-permuted."""
    for tensor in tensors:
        name = our_name(tensor.name)
        weight = torch.from_numpy(_to_numpy(tensor))
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope(weight, config.num_kv_heads)
        yield name, weight


def our_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = BLOCK_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        raise UnsupportedModel(f"unexpected GGUF tensor {gguf_name!r}")
    return f"layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}.weight"


def _to_numpy(tensor: Any) -> np.ndarray:
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order for a Q or K projection `[out, in]`."""
    out_features, in_features = weight.shape
    per_head_half = out_features // num_heads // 2
    return (
        weight.reshape(num_heads, per_head_half, 2, in_features)  # [H, D/2, 2, in]
        .transpose(1, 2)  # [H, 2, D/2, in]
        .reshape(out_features, in_features)
    )
