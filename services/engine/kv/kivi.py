"""INT4 KIVI quantization of one warm group: keys per channel, values per token, FP16 scales and zeros.

Reference PyTorch; the fused Triton kernels read the same layout: codes packed two per byte
(low nibble = even channel), one scale and zero point per group, stored in FP16.
Shapes: G tokens in the group, KVH kv heads, D head dim, VG value-group size (channels).

A group's key scales and zeros are stored in the fused decode kernel's order, not channel order
(see key_param_channels): `quantize_keys` writes that order and `dequantize_keys` reads it, so code
that goes through these two never sees it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

LEVELS = 15  # INT4: codes 0..15


class QuantizedKeys(NamedTuple):
    """Keys of one group: per-channel scale/zero shared by the group's G tokens."""

    codes: torch.Tensor  # [G, KVH, D/2] uint8
    scale: torch.Tensor  # [KVH, D] fp16, in key_param_channels order
    zero: torch.Tensor  # [KVH, D] fp16, in key_param_channels order


def key_param_channels(head_dim: int) -> torch.Tensor:
    """The channel whose key scale (and zero) each stored slot holds, `[D]` int64.

    The fused decode kernel unpacks a 32-bit word of codes (channels 8w..8w+7) into four fp16 pairs,
    pair j holding channels 8w + j and 8w + j + 4, and applies each pair's scale and zero with one
    fused multiply-add on the pair. So the stored parameters are those pairs, pair j of every word
    side by side: slot 2 (j * D/8 + w) + h holds channel 8w + j + 4h. The kernel then reads, for
    each j, one contiguous run of words, laid out as the code words it scales. A head dim that is
    not a multiple of 8 (which the fused kernel does not take) keeps channel order.
    """
    if head_dim % 8:
        return torch.arange(head_dim)
    slot = torch.arange(head_dim)
    pair, half = slot // 2, slot % 2
    j, word = pair // (head_dim // 8), pair % (head_dim // 8)
    return 8 * word + j + 4 * half


def key_params_stored(params: torch.Tensor) -> torch.Tensor:
    """Key scales or zeros `[..., D]` in channel order -> the stored order (key_param_channels)."""
    return params[..., _key_param_index(params.shape[-1], params.device, stored=True)]


def key_params_natural(params: torch.Tensor) -> torch.Tensor:
    """Stored key scales or zeros `[..., D]` -> channel order (the inverse of key_params_stored)."""
    return params[..., _key_param_index(params.shape[-1], params.device, stored=False)]


@functools.cache
def _key_param_index(head_dim: int, device: torch.device, stored: bool) -> torch.Tensor:
    """The gather index of key_params_stored / _natural, made once per device: built on the host at
    every call, its copy to a GPU would wait for the stream (a prefill dequantizes every layer)."""
    channels = key_param_channels(head_dim)
    return (channels if stored else torch.argsort(channels)).to(device)


class QuantizedValues(NamedTuple):
    """Values of one group: per-token scale/zero for each group of VG channels."""

    codes: torch.Tensor  # [G, KVH, D/2] uint8
    scale: torch.Tensor  # [G, KVH, D/VG] fp16
    zero: torch.Tensor  # [G, KVH, D/VG] fp16


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """`[..., D]` codes in 0..15 -> `[..., D/2]` uint8."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`[..., D/2]` uint8 -> `[..., D]` uint8 codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max INT4 over `dim`; scales and zeros rounded to FP16 before use."""
    low = x.amin(dim=dim, keepdim=True).half()
    high = x.amax(dim=dim, keepdim=True).half()
    scale = ((high.float() - low.float()) / LEVELS).clamp_min(1e-6).half()
    codes = ((x.float() - low.float()) / scale.float()).round().clamp(0, LEVELS)
    return codes, scale.squeeze(dim), low.squeeze(dim)


def quantize_keys(keys: torch.Tensor) -> QuantizedKeys:
    """`[..., G, KVH, D]` -> per-channel INT4 (KIVI: key outliers live in fixed channels).

    Leading dims (e.g. layers) are independent groups, so one call can quantize every layer.
    """
    codes, scale, zero = _quantize(keys, dim=-3)
    return QuantizedKeys(pack_int4(codes), key_params_stored(scale), key_params_stored(zero))


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """`[N, G, KVH, D/2]` codes with `[N, KVH, D]` stored scale/zero -> `[N, G, KVH, D]` fp32."""
    scale, zero = key_params_natural(scale.float()), key_params_natural(zero.float())
    return unpack_int4(codes).float() * scale.unsqueeze(1) + zero.unsqueeze(1)


def quantize_values(values: torch.Tensor, group_size: int) -> QuantizedValues:
    """`[..., G, KVH, D]` -> per-token INT4 over groups of `min(group_size, D)` channels."""
    dim = values.shape[-1]
    value_group = min(group_size, dim)
    grouped = values.reshape(*values.shape[:-1], dim // value_group, value_group)
    codes, scale, zero = _quantize(grouped, dim=-1)
    return QuantizedValues(pack_int4(codes.reshape(values.shape)), scale, zero)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """`[N, G, KVH, D/2]` codes with `[N, G, KVH, D/VG]` scale/zero -> `[N, G, KVH, D]` fp32."""
    unpacked = unpack_int4(codes).float()  # [N, G, KVH, D]
    num, tokens, heads, dim = unpacked.shape
    groups = scale.shape[-1]
    grouped = unpacked.view(num, tokens, heads, groups, dim // groups)
    return (grouped * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).view(num, tokens, heads, dim)
