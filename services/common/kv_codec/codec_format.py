"""The INT2-sparse payload's header and layout: what `CODEC_INT2_SPARSE` means, without torch.

The kvstore checks payloads with this module alone (a service that never quantizes need not load
torch); services/kvstore/codec.py encodes and decodes. Layout, little-endian (L layers, T tokens,
K kept, H kv heads, D head dim, G group size):
    header          20 B   `HEADER` below
    token mask      ceil(T/8) B, bit t (LSB first) set when token t is kept
    key codes       L*K*H*D/4 B    [L, K, H, D] INT2, four codes per byte, low bits first
    key scales      [L, ceil(K/G), H, D]    scale dtype
    key zeros       [L, ceil(K/G), H, D]    scale dtype
    value codes     L*K*H*D/4 B    [L, K, H, D]
    value scales    [L, K, H, D/VG]  scale dtype, VG = min(G, D)
    value zeros     [L, K, H, D/VG]  scale dtype
"""

from __future__ import annotations

import math
import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np

MAGIC = b"TKI2"
VERSION = 1
CODES_PER_BYTE = 4
# magic, version, scale dtype, sparsity tier, reserved, group size, L, T, H, D, K
HEADER = struct.Struct("<4sBBBBHHHHHH")


class CodecError(ValueError):
    """A payload that is not a well-formed INT2-sparse block, or tensors the codec cannot encode."""


class ScaleDtype(IntEnum):
    """The dtype of scales and zero points, as recorded in the header."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3

    @property
    def num_bytes(self) -> int:
        """Bytes per scale or zero."""
        return 4 if self is ScaleDtype.FLOAT32 else 2


class SparsityTier(IntEnum):
    """Which branch of the entropy rule chose the kept tokens."""

    KEEP_ALL = 0
    TOP_K = 1
    PRUNE = 2


class BlockLayout(NamedTuple):
    """The dimensions a payload header declares."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    num_kept: int
    group_size: int
    scale_dtype: ScaleDtype
    tier: SparsityTier

    @property
    def value_group(self) -> int:
        """Channels per value scale."""
        return min(self.group_size, self.head_dim)

    @property
    def num_key_groups(self) -> int:
        """Token groups per key channel."""
        return math.ceil(self.num_kept / self.group_size)

    @property
    def code_bytes(self) -> int:
        """Bytes of one tensor's INT2 codes."""
        return self.num_layers * self.num_kept * self.num_kv_heads * self.head_dim // CODES_PER_BYTE

    @property
    def key_scale_count(self) -> int:
        """Key scales (and as many zeros)."""
        return self.num_layers * self.num_key_groups * self.num_kv_heads * self.head_dim

    @property
    def value_scale_count(self) -> int:
        """Value scales (and as many zeros)."""
        heads = self.num_layers * self.num_kept * self.num_kv_heads
        return heads * (self.head_dim // self.value_group)

    @property
    def mask_bytes(self) -> int:
        """Bytes of the kept-token bitmask."""
        return (self.num_tokens + 7) // 8

    @property
    def payload_bytes(self) -> int:
        """The whole payload's length."""
        scales = 2 * (self.key_scale_count + self.value_scale_count) * self.scale_dtype.num_bytes
        return HEADER.size + self.mask_bytes + 2 * self.code_bytes + scales

    @property
    def dense_shape(self) -> list[int]:
        """The block's shape as the wire names it: [layers, 2, tokens, kv_heads, head_dim]."""
        return [self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim]


def pack_header(layout: BlockLayout, token_mask: np.ndarray) -> bytes:
    """Header and token bitmask."""
    header = HEADER.pack(
        MAGIC,
        VERSION,
        layout.scale_dtype,
        layout.tier,
        0,
        layout.group_size,
        layout.num_layers,
        layout.num_tokens,
        layout.num_kv_heads,
        layout.head_dim,
        layout.num_kept,
    )
    bits = np.packbits(token_mask.astype(np.uint8), bitorder="little")
    return header + bits.tobytes()


def read_layout(payload: bytes | memoryview) -> BlockLayout:
    """The layout a payload declares; a CodecError when the header or the length is wrong."""
    if len(payload) < HEADER.size:
        raise CodecError(
            f"INT2-sparse payload of {len(payload)} B is shorter than its {HEADER.size} B header"
        )
    magic, version, scale_dtype, tier, _, group, layers, tokens, heads, dim, kept = HEADER.unpack_from(
        payload
    )
    if magic != MAGIC or version != VERSION:
        raise CodecError(f"not an INT2-sparse v{VERSION} payload (magic {magic!r}, version {version})")
    if scale_dtype not in ScaleDtype._value2member_map_ or tier not in SparsityTier._value2member_map_:
        raise CodecError(f"unknown scale dtype {scale_dtype} or sparsity tier {tier} in the payload header")
    layout = BlockLayout(layers, tokens, heads, dim, kept, group, ScaleDtype(scale_dtype), SparsityTier(tier))
    if min(layers, tokens, heads, dim, kept, group) < 1 or kept > tokens or dim % CODES_PER_BYTE:
        raise CodecError(f"inconsistent INT2-sparse header: {layout}")
    if dim % layout.value_group or len(payload) != layout.payload_bytes:
        raise CodecError(
            f"INT2-sparse payload is {len(payload)} B; its header {layout} needs {layout.payload_bytes} B"
        )
    return layout


def bf16_bytes(layout: BlockLayout) -> int:
    """What the same block takes in BF16, every token kept: the ratio's denominator."""
    return 2 * layout.num_layers * layout.num_tokens * layout.num_kv_heads * layout.head_dim * 2
