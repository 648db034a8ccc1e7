"""The cold tier's block codec: INT2 asymmetric group quantization of the tokens that attention uses.

One block holds the keys and values of T consecutive tokens for every layer. Encoding:
1. Token sparsity (sparsity.py): the attention mass each token received picks the tokens kept;
   the entropy of that distribution picks how many.
2. INT2 quantization of the kept tokens, KIVI style: keys per channel (min/max over groups of
   `group_size` tokens, since key outliers sit in fixed channels), values per token (min/max over
   groups of `group_size` channels). Codes 0..3, four to a byte; the payload layout is in
   codec_format.py.

Two implementations produce identical bytes: `encode_block`/`decode_block` (vectorised torch, runs
on the device that holds the tensors) and `encode_block_reference`/`decode_block_reference` (numpy,
one group at a time, the oracle). Nothing here imports the rest of the service, so the engine can
use this module as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from services.common.kv_codec.codec_format import (
    CODES_PER_BYTE,
    HEADER,
    BlockLayout,
    CodecError,
    ScaleDtype,
    SparsityTier,
    bf16_bytes,
    pack_header,
    read_layout,
)
from services.common.kv_codec.sparsity import (
    DEFAULT_SPARSITY,
    KEEP_ALL,
    SparsityRule,
    attention_entropy,
    choose_kept_tokens,
)

SCALE_TORCH_DTYPES = {
    ScaleDtype.FLOAT16: torch.float16,
    ScaleDtype.BFLOAT16: torch.bfloat16,
    ScaleDtype.FLOAT32: torch.float32,
}

LEVELS = 3  # INT2: codes 0..3
MIN_SCALE = 1e-5  # a constant group still gets a scale fp16 can hold, so decoding never divides by 0


@dataclass(frozen=True)
class CodecSettings:
    """Group size, scale dtype and sparsity rule of one encoding."""

    group_size: int = 32
    scale_dtype: ScaleDtype = ScaleDtype.FLOAT16
    sparsity: SparsityRule = DEFAULT_SPARSITY

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.group_size > 65535:
            raise ValueError(f"group size must be in 1..65535, got {self.group_size}")


class DecodedBlock(NamedTuple):
    """The kept tokens of a block, dequantized to fp32."""

    keys: torch.Tensor  # [L, K, H, D]
    values: torch.Tensor  # [L, K, H, D]
    token_mask: torch.Tensor  # [T] bool, True where a token was kept

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[L, T, H, D]` with zeros at the dropped tokens (mask them in attention)."""
        shape = (self.keys.shape[0], self.token_mask.numel(), *self.keys.shape[2:])
        keys = self.keys.new_zeros(shape)
        values = self.values.new_zeros(shape)
        keys[:, self.token_mask] = self.keys
        values[:, self.token_mask] = self.values
        return keys, values


def check_block(keys: torch.Tensor, values: torch.Tensor, token_mass: torch.Tensor) -> None:
    """Shapes and dtypes the codec can encode: keys and values `[L, T, H, D]`, D a multiple of 4."""
    if keys.dim() != 4 or keys.shape != values.shape:
        raise CodecError(
            f"keys and values must both be [layers, tokens, kv_heads, head_dim]; got "
            f"{list(keys.shape)} and {list(values.shape)}"
        )
    if not (keys.is_floating_point() and values.is_floating_point()):
        raise CodecError(f"keys and values must be floating point, got {keys.dtype} and {values.dtype}")
    num_layers, num_tokens, num_kv_heads, head_dim = keys.shape
    if head_dim % CODES_PER_BYTE:
        raise CodecError(f"head_dim must be a multiple of {CODES_PER_BYTE} to pack INT2, got {head_dim}")
    if min(num_layers, num_tokens, num_kv_heads) < 1 or max(keys.shape) > 65535:
        raise CodecError(f"every dimension must be in 1..65535, got {list(keys.shape)}")
    if token_mass.shape != (num_tokens,):
        raise CodecError(
            f"token mass must have one value per token ({num_tokens}), got {list(token_mass.shape)}"
        )
    if not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        raise CodecError("keys and values must be finite; a block with inf or nan cannot be quantized")


def layout_for(keys: torch.Tensor, num_kept: int, settings: CodecSettings, tier: SparsityTier) -> BlockLayout:
    """The layout of `keys` `[L, T, H, D]` encoded with `num_kept` tokens."""
    num_layers, num_tokens, num_kv_heads, head_dim = keys.shape
    layout = BlockLayout(
        num_layers,
        num_tokens,
        num_kv_heads,
        head_dim,
        num_kept,
        settings.group_size,
        settings.scale_dtype,
        tier,
    )
    if head_dim % layout.value_group:
        raise CodecError(f"head_dim {head_dim} is not a multiple of the value group {layout.value_group}")
    return layout


def read_token_mask(payload: bytes | memoryview, layout: BlockLayout) -> torch.Tensor:
    """The `[T]` bool mask of kept tokens; a CodecError when it disagrees with the header's count,
    when it sets a bit past the block's T tokens, or when a keep-all block drops a token."""
    bits = np.frombuffer(payload, np.uint8, layout.mask_bytes, HEADER.size)
    unpacked = np.unpackbits(bits, bitorder="little")
    if unpacked[layout.num_tokens :].any():
        raise CodecError(f"token mask sets a bit past the block's {layout.num_tokens} tokens")
    mask = unpacked[: layout.num_tokens].astype(bool)
    if int(mask.sum()) != layout.num_kept:
        raise CodecError(f"token mask keeps {int(mask.sum())} tokens; the header says {layout.num_kept}")
    if layout.tier is SparsityTier.KEEP_ALL and layout.num_kept != layout.num_tokens:
        raise CodecError(f"a keep-all block keeps {layout.num_kept} of its {layout.num_tokens} tokens")
    return torch.from_numpy(mask.copy())


# --- vectorised (torch) ---------------------------------------------------------------------------


def _quantize(x: torch.Tensor, dim: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Asymmetric INT2 over `dim`: codes, scale, zero. Scales and zeros are rounded before use."""
    low = x.amin(dim=dim, keepdim=True).to(scale_dtype).float()
    high = x.amax(dim=dim, keepdim=True).to(scale_dtype).float()
    scale = ((high - low) / LEVELS).clamp_min(MIN_SCALE).to(scale_dtype).float()
    codes = ((x - low) / scale).round().clamp(0, LEVELS).to(torch.uint8)
    return codes, scale.squeeze(dim).to(scale_dtype), low.squeeze(dim).to(scale_dtype)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """`[..., D]` codes in 0..3 -> `[..., D/4]` uint8, code 4i+j in bits 2j..2j+1."""
    c = codes.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """`[..., D/4]` uint8 -> `[..., D]` uint8 codes."""
    parts = [(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).flatten(-2)


def _quantize_keys(keys: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """`[L, K, H, D]` -> codes `[L, K, H, D]`, scale/zero `[L, ceil(K/G), H, D]` (per channel)."""
    num_layers, num_kept, heads, dim = keys.shape
    num_groups = math.ceil(num_kept / group)
    padding = num_groups * group - num_kept
    # padding repeats the last kept token, which leaves each group's min and max unchanged
    padded = torch.cat([keys, keys[:, -1:].expand(num_layers, padding, heads, dim)], dim=1)
    grouped = padded.view(num_layers, num_groups, group, heads, dim)
    codes, scale, zero = _quantize(grouped, dim=2, scale_dtype=dtype)
    return codes.view(num_layers, num_groups * group, heads, dim)[:, :num_kept], scale, zero


def _quantize_values(values: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """`[L, K, H, D]` -> codes `[L, K, H, D]`, scale/zero `[L, K, H, D/VG]` (per token)."""
    *lead, dim = values.shape
    grouped = values.reshape(*lead, dim // group, group)
    codes, scale, zero = _quantize(grouped, dim=-1, scale_dtype=dtype)
    return codes.reshape(values.shape), scale, zero


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode_block(
    keys: torch.Tensor,
    values: torch.Tensor,
    token_mass: torch.Tensor,
    settings: CodecSettings = CodecSettings(),
) -> bytes:
    """Keys and values `[L, T, H, D]` (any float dtype, any device) and `[T]` mass -> payload."""
    check_block(keys, values, token_mass)
    token_mask, tier = choose_kept_tokens(token_mass, settings.sparsity)
    layout = layout_for(keys, int(token_mask.sum()), settings, tier)
    kept = token_mask.to(keys.device)
    dtype = SCALE_TORCH_DTYPES[settings.scale_dtype]
    key_parts = _quantize_keys(keys[:, kept].float(), min(settings.group_size, layout.num_kept), dtype)
    value_parts = _quantize_values(values[:, kept].float(), layout.value_group, dtype)
    key_codes, key_scale, key_zero = key_parts
    value_codes, value_scale, value_zero = value_parts
    pieces = [pack_int2(key_codes), key_scale, key_zero, pack_int2(value_codes), value_scale, value_zero]
    return pack_header(layout, token_mask.cpu().numpy()) + b"".join(_as_bytes(p) for p in pieces)


def _read_tensor(payload: bytes | memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    num_bytes = count * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(bytearray(payload[offset : offset + num_bytes]), dtype=torch.uint8)
    return raw.view(dtype)


class _Sections(NamedTuple):
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor


def _split(payload: bytes | memoryview, layout: BlockLayout) -> _Sections:
    """The six tensors of a payload, flat, in payload order."""
    dtype = SCALE_TORCH_DTYPES[layout.scale_dtype]
    sizes = [
        (layout.code_bytes, torch.uint8),
        (layout.key_scale_count, dtype),
        (layout.key_scale_count, dtype),
        (layout.code_bytes, torch.uint8),
        (layout.value_scale_count, dtype),
        (layout.value_scale_count, dtype),
    ]
    offset, parts = HEADER.size + layout.mask_bytes, []
    for count, part_dtype in sizes:
        parts.append(_read_tensor(payload, offset, count, part_dtype))
        offset += count * parts[-1].element_size()
    return _Sections(*parts)


def decode_block(payload: bytes | memoryview, device: torch.device | str = "cpu") -> DecodedBlock:
    """Payload -> the kept tokens' keys and values `[L, K, H, D]` in fp32 on `device`, and the mask."""
    layout = read_layout(payload)
    mask = read_token_mask(payload, layout)
    s = _split(payload, layout)
    num_layers, num_kept, heads, dim = (
        layout.num_layers,
        layout.num_kept,
        layout.num_kv_heads,
        layout.head_dim,
    )
    group, num_groups = min(layout.group_size, num_kept), layout.num_key_groups
    key_codes = unpack_int2(s.key_codes.to(device).view(num_layers, num_kept, heads, dim // 4)).float()
    key_scale = s.key_scale.to(device).float().view(num_layers, num_groups, heads, dim)
    key_zero = s.key_zero.to(device).float().view(num_layers, num_groups, heads, dim)
    token_group = torch.arange(num_kept, device=device) // group
    keys = key_codes * key_scale[:, token_group] + key_zero[:, token_group]
    value_codes = unpack_int2(s.value_codes.to(device).view(num_layers, num_kept, heads, dim // 4)).float()
    value_group = layout.value_group
    value_shape = (num_layers, num_kept, heads, dim // value_group, 1)
    grouped = value_codes.view(num_layers, num_kept, heads, dim // value_group, value_group)
    scale = s.value_scale.to(device).float().view(value_shape)
    zero = s.value_zero.to(device).float().view(value_shape)
    values = (grouped * scale + zero).view(num_layers, num_kept, heads, dim)
    return DecodedBlock(keys, values, mask.to(device))


# --- reference (numpy, one group at a time) -------------------------------------------------------


def _round_to(x: np.ndarray | np.floating, dtype: ScaleDtype) -> np.ndarray:
    """Round fp32 values to the scale dtype and back, as the stored scales are."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(SCALE_TORCH_DTYPES[dtype]).float().numpy()


def _reference_group(x: np.ndarray, dtype: ScaleDtype) -> tuple[np.ndarray, np.float32, np.float32]:
    """One group of fp32 values -> codes, scale, zero (scale and zero already rounded)."""
    low = _round_to(x.min(), dtype)
    high = _round_to(x.max(), dtype)
    scale = _round_to(np.maximum((high - low) / np.float32(LEVELS), np.float32(MIN_SCALE)), dtype)
    codes = np.clip(np.round((x - low) / scale), 0, LEVELS).astype(np.uint8)
    return codes, np.float32(scale), np.float32(low)


def _reference_pack(codes: np.ndarray) -> bytes:
    flat = codes.reshape(-1, 4).astype(np.uint8)
    return (flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6)).astype(np.uint8).tobytes()


def _scale_bytes(values: np.ndarray, dtype: ScaleDtype) -> bytes:
    return _as_bytes(torch.from_numpy(values.astype(np.float32)).to(SCALE_TORCH_DTYPES[dtype]))


def encode_block_reference(
    keys: torch.Tensor,
    values: torch.Tensor,
    token_mass: torch.Tensor,
    settings: CodecSettings = CodecSettings(),
) -> bytes:
    """The oracle for `encode_block`: the same bytes, computed group by group in numpy."""
    check_block(keys, values, token_mass)
    token_mask, tier = choose_kept_tokens(token_mass, settings.sparsity)
    layout = layout_for(keys, int(token_mask.sum()), settings, tier)
    mask = token_mask.numpy()
    k = keys.detach().float().cpu().numpy()[:, mask]  # [L, K, H, D]
    v = values.detach().float().cpu().numpy()[:, mask]
    num_layers, num_kept, heads, dim = k.shape
    group = min(settings.group_size, num_kept)
    key_codes = np.zeros(k.shape, np.uint8)
    key_scale = np.zeros((num_layers, layout.num_key_groups, heads, dim), np.float32)
    key_zero = np.zeros_like(key_scale)
    for layer in range(num_layers):
        for g in range(layout.num_key_groups):
            tokens = slice(g * group, min((g + 1) * group, num_kept))
            for head in range(heads):
                for channel in range(dim):
                    codes, scale, zero = _reference_group(
                        k[layer, tokens, head, channel], settings.scale_dtype
                    )
                    key_codes[layer, tokens, head, channel] = codes
                    key_scale[layer, g, head, channel], key_zero[layer, g, head, channel] = scale, zero
    value_group = layout.value_group
    value_codes = np.zeros(v.shape, np.uint8)
    value_scale = np.zeros((num_layers, num_kept, heads, dim // value_group), np.float32)
    value_zero = np.zeros_like(value_scale)
    for index in np.ndindex(num_layers, num_kept, heads, dim // value_group):
        channels = slice(index[3] * value_group, (index[3] + 1) * value_group)
        codes, scale, zero = _reference_group(v[(*index[:3], channels)], settings.scale_dtype)
        value_codes[(*index[:3], channels)] = codes
        value_scale[index], value_zero[index] = scale, zero
    dtype = settings.scale_dtype
    return (
        pack_header(layout, token_mask.cpu().numpy())
        + _reference_pack(key_codes)
        + _scale_bytes(key_scale, dtype)
        + _scale_bytes(key_zero, dtype)
        + _reference_pack(value_codes)
        + _scale_bytes(value_scale, dtype)
        + _scale_bytes(value_zero, dtype)
    )


def decode_block_reference(payload: bytes | memoryview) -> DecodedBlock:
    """The oracle for `decode_block`: one element at a time from the payload's sections."""
    layout = read_layout(payload)
    mask = read_token_mask(payload, layout)
    s = _split(payload, layout)
    num_layers, num_kept, heads, dim = (
        layout.num_layers,
        layout.num_kept,
        layout.num_kv_heads,
        layout.head_dim,
    )
    packed_keys, packed_values = s.key_codes.numpy(), s.value_codes.numpy()
    key_scale, key_zero = s.key_scale.float().numpy(), s.key_zero.float().numpy()
    value_scale, value_zero = s.value_scale.float().numpy(), s.value_zero.float().numpy()
    group, value_group = min(layout.group_size, num_kept), layout.value_group
    keys = np.zeros((num_layers, num_kept, heads, dim), np.float32)
    values = np.zeros_like(keys)
    for flat, (layer, token, head, channel) in enumerate(np.ndindex(keys.shape)):
        code_k = (packed_keys[flat // 4] >> (2 * (flat % 4))) & 0x3
        code_v = (packed_values[flat // 4] >> (2 * (flat % 4))) & 0x3
        key_index = ((layer * layout.num_key_groups + token // group) * heads + head) * dim + channel
        value_index = ((layer * num_kept + token) * heads + head) * (
            dim // value_group
        ) + channel // value_group
        keys[layer, token, head, channel] = code_k * key_scale[key_index] + key_zero[key_index]
        values[layer, token, head, channel] = code_v * value_scale[value_index] + value_zero[value_index]
    return DecodedBlock(torch.from_numpy(keys), torch.from_numpy(values), mask)


__all__ = [
    "HEADER",
    "KEEP_ALL",
    "BlockLayout",
    "CodecError",
    "CodecSettings",
    "DecodedBlock",
    "ScaleDtype",
    "SparsityRule",
    "SparsityTier",
    "attention_entropy",
    "bf16_bytes",
    "choose_kept_tokens",
    "decode_block",
    "decode_block_reference",
    "encode_block",
    "encode_block_reference",
    "read_layout",
]
