"""Rotary position embeddings (rotate-half layout) with default, linear, llama3 and GGUF-factor scaling."""

from __future__ import annotations

import math

import torch

from services.engine.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation speed, fp32 `[head_dim // 2]`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if scaling.rope_type == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        return inv_freq / factors
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable(torch.nn.Module):
    """Precomputed cos/sin for every position up to `max_positions`; looked up per token."""

    cos: torch.Tensor  # [P, D] fp32
    sin: torch.Tensor  # [P, D] fp32

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """(Re)compute the tables on the buffers' device; needed after `to_empty`."""
        device = self.cos.device
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)  # [D/2]
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)  # [P]
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` `[T]`, each `[T, 1, D]` in `dtype` (one angle for every head)."""
        cos = self.cos[positions].to(dtype).unsqueeze(-2)  # [T, 1, D]
        sin = self.sin[positions].to(dtype).unsqueeze(-2)  # [T, 1, D]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` by the angles in cos/sin `[T, 1, D]` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, H, D]
    return x * cos + rotated * sin
