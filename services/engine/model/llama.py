"""Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. One code path for CPU and CUDA.

Module names follow Hugging Face's `LlamaForCausalLM` (minus the `model.` prefix) so checkpoints map 1:1.
Shapes: B batch rows, S new tokens per row, L visible cache positions, E hidden, H/KVH heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.execution.step_context import StepContext
from services.engine.kv.cache import KVCache
from services.engine.model.config import ModelConfig
from services.engine.model.rotary import RotaryTable, apply_rotary
from services.engine.model.tensor_parallel import SINGLE, TensorParallel, shard_config


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as Llama does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim of `x` `[..., E]`."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the KV cache; `config` holds this rank's share of the heads."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        ctx: StepContext,
    ) -> torch.Tensor:
        """Attend `x` `[B, S, E]` to itself and the cached past; returns `[B, S, E]`."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)  # [B, S, H, D]
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)  # [B, S, KVH, D]
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)  # [B, S, KVH, D]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        keys, values = kv_cache.store(self.layer, k, v, ctx)  # [B, KVH, L, D] each
        if ctx.probe is not None and ctx.probe.layer == self.layer:  # sampled decode step
            ctx.probe.record(q.transpose(1, 2), keys, ctx.attn_mask)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=ctx.attn_mask, enable_gqa=True
        )  # [B, H, S, D]
        return self.tp.all_reduce(self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)))  # [B, S, E]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); `config` holds this rank's share of the width."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S, E]` -> `[B, S, E]`."""
        return self.tp.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, ctx: StepContext
    ) -> torch.Tensor:
        """`[B, S, E]` -> `[B, S, E]`."""
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so (redo after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        """Token ids `[B, S]` -> final normed hidden states `[B, S, E]` (the safety gate reads these)."""
        x = self.embed_tokens(input_ids)  # [B, S, E]
        rope = self.rotary(ctx.positions, x.dtype)  # 2 x [B, S, 1, D]
        for layer in self.layers:
            x = layer(x, rope, kv_cache, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[..., E]` -> fp32 logits `[..., V]`."""
        return self.lm_head(hidden).float()
