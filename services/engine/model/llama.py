"""Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. One code path for CPU and CUDA.

Tokens are packed: a step's new tokens from every row form one `[T, E]` batch with no padding, and
attention (a pluggable backend) knows from the step's metadata which row each token belongs to.
Q, K and V are one projection, as are the MLP's gate and up; checkpoints still name them apart
(Hugging Face's `LlamaForCausalLM` names, minus `model.`), and `weight_slot` maps each name to
its rows of the merged weight.
Shapes: T packed tokens, E hidden, H/KVH heads (this rank's share), D head dim, I MLP width.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata
from services.engine.kv.cache import KVCache
from services.engine.model import fused_ops
from services.engine.model.config import ModelConfig
from services.engine.model.rotary import RotaryTable, apply_rotary
from services.engine.model.tensor_parallel import SINGLE, TensorParallel, shard_config

# checkpoint projection -> (merged module, index of its part)
MERGED_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as Llama does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel for add_and_norm (CUDA; see LlamaModel.use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim of `x` `[..., E]`."""
        return fused_ops.rmsnorm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of `residual + x`, and `residual + x` (the new residual stream)."""
        if self.fused:
            return fused_ops.add_rmsnorm(x, residual, self.weight, self.eps)
        return fused_ops.add_rmsnorm_reference(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention over the KV cache; `config` holds this rank's share of the heads."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.fused = False  # RoPE and the K/V write in one Triton kernel (CUDA)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend `x` `[T, E]` to itself and the cached past; returns `[T, E]`.

        `rope` is cos/sin at the tokens' positions `[T, 1, D]`, or with `fused` the whole fp32 tables
        `[P, D]` (the kernel looks up `metadata.positions` itself).
        """
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        if self.fused:
            keys, values = kv_cache.hot_layer(self.layer)
            q, k, v = fused_ops.rotary_and_store(
                qkv, self.num_heads, self.num_kv_heads, *rope, metadata.positions, keys, values,
                metadata.slot_mapping,
            )  # fmt: skip
        else:
            q, k, v = qkv.split(self.split_sizes, dim=-1)
            q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), *rope)  # [T, H, D]
            k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), *rope)  # [T, KVH, D]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
            kv_cache.store(self.layer, k, v, metadata.slot_mapping)
        if metadata.probe is not None and metadata.probe.layer == self.layer:  # sampled decode step
            metadata.probe.record(kv_cache, q, metadata)
        if metadata.query_tap is not None and metadata.query_tap.layer == self.layer:  # cold scoring
            metadata.query_tap.record(q)
        out = attention.attend(q, k, v, self.layer, metadata)  # [T, H, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1)))  # [T, E]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); `config` holds this rank's share of the width."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.split_sizes = [config.intermediate_size, config.intermediate_size]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused = False  # SiLU(gate) * up in one Triton kernel (CUDA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, E]` -> `[T, E]`."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate then up
        hidden = fused_ops.silu_mul(gate_up) if self.fused else fused_ops.silu_mul_reference(gate_up)
        return self.tp.all_reduce(self.down_proj(hidden))


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's MLP output `[T, E]` and the residual stream before it; the next norm adds them."""
        normed, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(normed, rope, kv_cache, attention, metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """The decoder stack plus the LM head; `forward` returns final normed hidden states, not logits.

    Under tensor parallelism each rank builds the same stack over its share of the heads and MLP
    width (`shard_config`); `config` stays the whole model's.
    """

    def __init__(
        self, config: ModelConfig, max_positions: int | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.rank_config = shard_config(config, tp.size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.rank_config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryTable(config, max_positions or config.max_position_embeddings)
        self.fused_ops = False

    def use_fused_ops(self, enabled: bool) -> None:
        """Run the small ops (add + RMSNorm, RoPE + K/V write, SiLU·mul) as fused Triton kernels (CUDA)."""
        self.fused_ops = enabled
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fused = enabled

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so (redo after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Packed token ids `[T]` -> final normed hidden states `[T, E]` (the safety gate reads these)."""
        x = self.embed_tokens(input_ids)  # [T, E]
        if self.fused_ops:  # the fused kernel reads the tables at the positions itself
            rope = (self.rotary.cos, self.rotary.sin)  # 2 x [P, D] fp32
        else:
            rope = self.rotary(metadata.positions, x.dtype)  # 2 x [T, 1, D]
        residual = torch.zeros_like(x)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, kv_cache, attention, metadata)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[..., E]` -> fp32 logits `[..., V]`."""
        return self.lm_head(hidden).float()

    def weight_slot(self, name: str) -> torch.Tensor:
        """The parameter, or rows of a merged one, that checkpoint tensor `name` fills."""
        prefix, _, leaf = name.rpartition(".")  # "layers.3.self_attn.q_proj", "weight"
        for part, (merged, index) in MERGED_PROJECTIONS.items():
            if prefix.endswith(part):
                owner = prefix.removesuffix(part)  # "layers.3."
                sizes: list[int] = self.get_submodule(owner + merged.split(".")[0]).split_sizes  # type: ignore[assignment]
                start = sum(sizes[:index])
                return self.get_parameter(f"{owner}{merged}.{leaf}")[start : start + sizes[index]]
        return self.get_parameter(name)

    def checkpoint_names(self) -> set[str]:
        """Every tensor name a checkpoint must provide (merged projections by their parts' names)."""
        names: set[str] = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            prefix, _, leaf = name.rpartition(".")
            parts = [p for p, (merged, _) in MERGED_PROJECTIONS.items() if prefix.endswith(merged)]
            owner = prefix.rsplit(".", 2)[0] + "." if parts else ""
            names.update(f"{owner}{p}.{leaf}" for p in parts)
            if not parts:
                names.add(name)
        return names
