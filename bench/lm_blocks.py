"""The first blocks of a Llama from its GGUF file, with optional LoRA factors: the trunk that
bench/safety_lm_finetune.py fine-tunes as a harm classifier (issue 13, point 2).

A Llama block written out (RMSNorm, rotary attention with grouped KV heads, SwiGLU), in fp32 or
bf16, over right-padded rows (attention is causal, so no real position reads a pad). The engine's
paged runtime serves decode and is not a fit for training; tests/tools/test_lm_blocks.py holds
this forward to transformers' Llama on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FRAME_HEAD = "<|im_start|>user\n"
FRAME_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
PROJECTIONS = {  # our short name -> the GGUF tensor's
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


@dataclass(frozen=True)
class LlamaShape:
    """What the forward needs of the model's configuration."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved-RoPE row order of a Q or K projection back to the half-split one.

    The engine's loader has the same function; this copy serves bench/safety_lm_finetune.py's
    `run`, which rebuilds the trunk on a GPU machine that has neither gguf nor the engine's deps."""
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


class LlamaBlocks(torch.nn.Module):
    """The embedding and first blocks of a Llama, frozen, with optional LoRA factors per projection
    (`rank` > 0: `A` small random, `B` zero, so training starts from the model as it is)."""

    def __init__(
        self,
        shape: LlamaShape,
        tensors: dict[str, torch.Tensor],
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
        alpha: float = 0.0,
    ) -> None:
        super().__init__()
        self.shape, self.num_blocks, self.rank = shape, num_blocks, rank
        self.scale = alpha / rank if rank else 0.0
        self.frozen = {
            name: t.to(dtype if t.dim() == 2 else torch.float32)
            for name, t in tensors.items()
            if name == "embed" or int(name.split(".")[0]) < num_blocks
        }
        self.lora = torch.nn.ParameterDict()
        if rank:
            generator = torch.Generator().manual_seed(0)
            for b in range(num_blocks):
                for p in PROJECTIONS:
                    out_features, in_features = self.frozen[f"{b}.{p}"].shape
                    a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                    self.lora[f"{b}_{p}_a"] = torch.nn.Parameter(a)
                    self.lora[f"{b}_{p}_b"] = torch.nn.Parameter(torch.zeros(out_features, rank))
        dim = shape.head_dim
        self.inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, dim, 2).float() / dim)

    def to_device(self, device: torch.device) -> LlamaBlocks:
        """Moves the frozen tensors as well as the factors."""
        self.frozen = {k: v.to(device) for k, v in self.frozen.items()}
        self.inv_freq = self.inv_freq.to(device)
        return self.to(device)

    def _linear(self, x: torch.Tensor, block: int, proj: str) -> torch.Tensor:
        y = x @ self.frozen[f"{block}.{proj}"].T
        if self.rank:
            a, b = self.lora[f"{block}_{proj}_a"], self.lora[f"{block}_{proj}_b"]
            y = y + self.scale * ((x @ a.to(x.dtype).T) @ b.to(x.dtype).T)
        return y

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.shape.eps) * weight
        return normed.to(x.dtype)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[2], device=x.device).float(), self.inv_freq)
        cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream `[B, T, H]` after the blocks. Rows are right-padded: attention is
        causal, so no real position reads a pad."""
        s = self.shape
        x = self.frozen["embed"][ids]
        batch, seq, _ = x.shape
        for b in range(self.num_blocks):
            h = self._norm(x, self.frozen[f"{b}.attn_norm"])
            q = self._linear(h, b, "q").view(batch, seq, s.heads, s.head_dim).transpose(1, 2)
            k = self._linear(h, b, "k").view(batch, seq, s.kv_heads, s.head_dim).transpose(1, 2)
            v = self._linear(h, b, "v").view(batch, seq, s.kv_heads, s.head_dim).transpose(1, 2)
            group = s.heads // s.kv_heads
            k, v = self._rope(k).repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(self._rope(q), k, v, is_causal=True)
            x = x + self._linear(attn.transpose(1, 2).reshape(batch, seq, -1), b, "o")
            h = self._norm(x, self.frozen[f"{b}.ffn_norm"])
            x = x + self._linear(F.silu(self._linear(h, b, "gate")) * self._linear(h, b, "up"), b, "down")
        return x


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` and lengths `[B]`."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, : len(row)] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])
