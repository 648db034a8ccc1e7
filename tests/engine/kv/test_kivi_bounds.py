"""KIVI INT4 round trips, bounded by the input alone: the error of each key channel (values: each
token's channel group) is at most half of that slice's range over 15 levels, plus FP16 rounding of
the slice's min and max. The bound never reads the quantizer's own scales, so a codec that stored a
wrong scale, mixed channels or tokens up, or swapped nibbles would fail it."""

from __future__ import annotations

import torch

from services.engine.kv import kivi

FP16_EPS = 2.0**-10  # the FP16 rounding of a slice's min, max and step, relative to their magnitude


def _bound(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Largest error a 16-level min/max quantizer may make on each slice of `x` reduced over `dim`."""
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    magnitude = torch.maximum(low.abs(), high.abs())
    return (high - low) / (2 * kivi.LEVELS) + 2 * magnitude * FP16_EPS + 1e-6


def _keys_round_trip(keys: torch.Tensor) -> torch.Tensor:
    quantized = kivi.quantize_keys(keys)
    return kivi.dequantize_keys(quantized.codes[None], quantized.scale[None], quantized.zero[None])[0]


def _values_round_trip(values: torch.Tensor, group_size: int) -> torch.Tensor:
    quantized = kivi.quantize_values(values, group_size)
    return kivi.dequantize_values(quantized.codes[None], quantized.scale[None], quantized.zero[None])[0]


def _inputs(seed: int) -> torch.Tensor:
    """[G=32, KVH=2, D=16] keys or values: Gaussian, channels at scales from 0.01 to 100."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 2, 16)
    return torch.randn(32, 2, 16, generator=generator) * scales + torch.randn(16, generator=generator)


def test_keys_round_trip_within_each_channels_own_range() -> None:
    for seed in range(8):
        keys = _inputs(seed)
        error = (_keys_round_trip(keys) - keys).abs()
        assert (error <= _bound(keys, dim=0)).all(), (
            f"seed {seed}: worst {(error / _bound(keys, 0)).max():.2f}x"
        )


def test_values_round_trip_within_each_tokens_channel_group_range() -> None:
    group_size = 4
    for seed in range(8):
        values = _inputs(seed)
        grouped = values.view(32, 2, 16 // group_size, group_size)
        bound = _bound(grouped, dim=-1).expand_as(grouped).reshape(values.shape)
        error = (_values_round_trip(values, group_size) - values).abs()
        assert (error <= bound).all(), f"seed {seed}: worst {(error / bound).max():.2f}x"


def test_an_outlier_key_channel_leaves_the_other_channels_precise() -> None:
    keys = _inputs(0)
    keys[:, :, 3] *= 1000.0  # the fixed outlier channel KIVI quantizes keys per channel for
    error = (_keys_round_trip(keys) - keys).abs()
    others = [c for c in range(16) if c != 3]
    assert (error[..., others] <= _bound(keys, dim=0)[..., others]).all()


def test_sixteen_evenly_spaced_levels_and_constant_slices_survive_exactly() -> None:
    levels = torch.arange(16, dtype=torch.float32) * 0.25 - 1.0  # exact in FP16, step 0.25
    keys = levels.view(16, 1, 1).expand(16, 2, 4).clone()
    keys[:, 1, :] = 3.0  # a constant channel
    assert torch.equal(_keys_round_trip(keys), keys)
    values = levels.view(1, 1, 16).expand(3, 2, 16).clone()
    assert torch.equal(_values_round_trip(values, group_size=16), values)
