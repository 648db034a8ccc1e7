"""KVStoreClient against a real kvstore process over a real redis-server: `get_into` writes a block
into the caller's buffer only when the store serves it in the codec, shape and size the buffer is
for; anything else is a CORRUPT miss, logged, and the buffer keeps what it held."""

from __future__ import annotations

import logging

import pytest

from services.common.kvstore_api import Codec, MissReason
from tests.kvstore.conftest import KVStoreProcess, raw_block, shared_kvstore

__all__ = ["shared_kvstore"]  # the fixture: one kvstore for this module, distinct hashes per test

STORED_SHAPE = (1, 2, 1500, 1, 1)  # raw_block's: [L, 2, T, KVH, D], 6,000 B of BF16


def test_get_into_fills_a_buffer_with_a_block_of_its_shape(shared_kvstore: KVStoreProcess) -> None:
    block = raw_block("get-into-fills")
    buffer = bytearray(len(block.payload))
    with shared_kvstore.client() as client:
        client.put([block])
        assert client.get_into([block.block_hash], [memoryview(buffer)], STORED_SHAPE) == [None]
    assert bytes(buffer) == block.payload


@pytest.mark.parametrize(
    ("shape", "num_bytes", "codec", "logged"),
    [
        # the same 6,000 B laid out as two kv heads of 750 tokens: only the shape tells them apart
        ((1, 2, 750, 2, 1), 6000, Codec.RAW, "served as [1, 2, 1500, 1, 1], expected [1, 2, 750, 2, 1]"),
        (STORED_SHAPE, 5998, Codec.RAW, "served 6,000 B, expected 5,998 B"),
        (STORED_SHAPE, 6000, Codec.INT2_SPARSE, "served in codec 1, expected 2 (INT2_SPARSE)"),
    ],
    ids=["shape", "size", "codec"],
)
def test_a_block_the_buffer_is_not_for_is_a_corrupt_miss_left_unwritten(
    shared_kvstore: KVStoreProcess,
    caplog: pytest.LogCaptureFixture,
    shape: tuple[int, ...],
    num_bytes: int,
    codec: Codec,
    logged: str,
) -> None:
    block = raw_block(f"get-into-not-{logged}")
    buffer = bytearray(num_bytes)
    with shared_kvstore.client() as client, caplog.at_level(logging.WARNING):
        client.put([block])
        assert client.get_into([block.block_hash], [memoryview(buffer)], shape, codec=codec) == [
            MissReason.CORRUPT
        ]
    assert buffer == bytearray(num_bytes)
    assert f"kvstore block {block.block_hash[:16]} is a miss: {logged}" in caplog.text
