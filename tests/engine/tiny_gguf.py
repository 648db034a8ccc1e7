"""Factory: write a tiny HF Llama as a llama.cpp-style GGUF (permuted Q/K, mixed quant types)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from services.engine.model.config import ModelConfig
from services.engine.model.rotary import inverse_frequencies
from services.engine.model.weights import read_hf_config, safetensors_files

Q = GGMLQuantizationType
# which GGML type each kind of tensor gets, to cover several dequantizers in one file
QUANT_OF = {
    "token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.F16, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1,
    "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.Q8_0,
}  # fmt: skip
HF_TO_GGUF = {
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
CONTROL, NORMAL = 3, 1


def gguf_name(hf_name: str) -> str:
    """`model.layers.1.mlp.up_proj.weight` -> `blk.1.ffn_up.weight`."""
    stem = hf_name.removeprefix("model.").removesuffix(".weight")
    if stem.startswith("layers."):
        _, index, rest = stem.split(".", 2)
        return f"blk.{index}.{HF_TO_GGUF[rest]}.weight"
    return f"{HF_TO_GGUF[stem]}.weight"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows (rotate-half pairs -> interleaved pairs)."""
    out_features, in_features = weight.shape
    return (
        weight.reshape(num_heads, 2, out_features // num_heads // 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


def round_trip(weight: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a weight becomes after quantizing to `qtype` and back (row-wise blocks, so row order-free)."""
    return dequantize(quantize(weight, qtype), qtype).reshape(weight.shape)


def hf_to_gguf(hf_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write `out`; return the HF state dict as the GGUF file will reproduce it (quantization included)."""
    config = read_hf_config(hf_dir)
    state = {k: v for f in safetensors_files(hf_dir) for k, v in load_file(str(f)).items()}
    writer = GGUFWriter(str(out), arch="llama")
    _write_model_metadata(writer, config)
    _write_tokenizer(writer, hf_dir)
    expected = {}
    for name, tensor in state.items():
        weight = tensor.float().numpy()
        kind = gguf_name(name).split(".")[-2]
        qtype = QUANT_OF.get(kind, Q.F32)
        expected[name] = torch.from_numpy(round_trip(weight, qtype) if qtype != Q.F32 else weight)
        if kind in ("attn_q", "attn_k"):
            weight = llama_cpp_permute(weight, config.num_heads if kind == "attn_q" else config.num_kv_heads)
        _add_tensor(writer, gguf_name(name), weight, qtype)
    if config.rope_scaling.rope_type == "llama3":  # llama.cpp stores llama3 scaling as per-dim divisors
        _add_tensor(writer, "rope_freqs.weight", _llama3_freq_factors(config), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _add_tensor(writer: GGUFWriter, name: str, weight: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, weight.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)


def _llama3_freq_factors(config: ModelConfig) -> np.ndarray:
    from services.engine.model.config import RopeScaling

    plain = inverse_frequencies(config.head_dim, config.rope_theta, RopeScaling())
    scaled = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    return (plain / scaled).numpy().astype(np.float32)


def _write_model_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)


def _write_tokenizer(writer: GGUFWriter, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok_config["chat_template"])
