"""The block types the store gives back, and the checks a block passes before it is written.

The types callers share (`BlockIn`, `Codec`, `BlockSource`, `MissReason`) live in
services/common/kvstore_api.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidArgument
from services.common.kv_codec import codec_format as codec
from services.common.kvstore_api import BlockHash, BlockIn, BlockSource, Codec, MissReason
from services.kvstore.record import MAX_DIMS, Record

__all__ = ["BlockFound", "BlockIn", "BlockMissing", "BlockSource", "Codec", "MissReason", "check_block"]

RAW_BYTES_PER_VALUE = 2  # CODEC_RAW is BF16


@dataclass(frozen=True)
class BlockFound:
    """A block served."""

    block_hash: BlockHash
    record: Record
    source: BlockSource


@dataclass(frozen=True)
class BlockMissing:
    """A block not served, and why."""

    block_hash: BlockHash
    reason: MissReason


def check_block(block: BlockIn, max_block_bytes: int) -> None:
    """Refuses, with a message the caller can act on, a block whose payload does not match its header."""
    where = f"block {block.block_hash}"
    if block.codec not in Codec._value2member_map_:
        raise InvalidArgument(f"{where}: codec {int(block.codec)} is not CODEC_RAW or CODEC_INT2_SPARSE")
    if not 1 <= len(block.shape) <= MAX_DIMS or min(block.shape) < 1:
        raise InvalidArgument(
            f"{where}: shape {list(block.shape)} must have 1..{MAX_DIMS} positive dimensions"
        )
    if len(block.payload) > max_block_bytes:
        raise InvalidArgument(
            f"{where}: payload of {len(block.payload)} B exceeds the store's limit of {max_block_bytes} B "
            "(THERMOCLINE_KVSTORE_MAX_BLOCK_MB); store smaller blocks"
        )
    if block.codec == Codec.RAW:
        expected = math.prod(block.shape) * RAW_BYTES_PER_VALUE
        if len(block.payload) != expected:
            raise InvalidArgument(
                f"{where}: a CODEC_RAW payload of shape {list(block.shape)} is {expected} B of BF16, "
                f"got {len(block.payload)} B"
            )
        return
    try:
        layout = codec.read_layout(block.payload)
    except codec.CodecError as error:
        raise InvalidArgument(f"{where}: {error}") from None
    if list(block.shape) != layout.dense_shape:
        raise InvalidArgument(
            f"{where}: shape {list(block.shape)} disagrees with its INT2-sparse payload's "
            f"{layout.dense_shape}"
        )
    _check_token_mask(block.payload, layout, where)


def _check_token_mask(payload: bytes, layout: codec.BlockLayout, where: str) -> None:
    """The kept-token mask agrees with the header, as the engine's decode checks it: a block it
    would drop as corrupt on every read is refused at the put instead."""
    bits = np.unpackbits(
        np.frombuffer(payload, np.uint8, layout.mask_bytes, codec.HEADER.size), bitorder="little"
    )
    num_kept = int(bits[: layout.num_tokens].sum())
    if bits[layout.num_tokens :].any() or num_kept != layout.num_kept:
        raise InvalidArgument(
            f"{where}: its INT2-sparse token mask keeps {num_kept} tokens (or marks tokens past the "
            f"block's {layout.num_tokens}); its header says {layout.num_kept}"
        )
    if layout.tier is codec.SparsityTier.KEEP_ALL and layout.num_kept != layout.num_tokens:
        raise InvalidArgument(
            f"{where}: a keep-all block keeps {layout.num_kept} of {layout.num_tokens} tokens"
        )
