"""A loaded prefix written into its hot blocks piece by piece (KVCache.prefix_writer), on the CPU and,
where there is one, on a GPU: there on a stream of its own, through the landing buffer, chunk by
chunk. Every block lands where it was asked to, in the cache's dtype, and nothing else changes."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv import cache as cache_module
from services.engine.kv.cache import HotTier, KVCache
from services.engine.model.config import ModelConfig

CONFIG = ModelConfig(
    vocab_size=4, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=4
)
BLOCK_SIZE = 4
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def host_blocks(num_blocks: int, pin: bool) -> torch.Tensor:
    """Stored prompt blocks `[n, L, 2, BS, KVH, D]`, BF16, each value telling block, layer and slot apart."""
    shape = (num_blocks, CONFIG.num_layers, 2, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim)
    blocks = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) % 251 + 1
    blocks = blocks.to(torch.bfloat16)
    return blocks.pin_memory() if pin else blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_land_in_their_blocks_and_nothing_else_moves(
    device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # three blocks per device chunk: pieces of 5 and 4 blocks split across chunks unevenly
    one_block = CONFIG.num_layers * 2 * BLOCK_SIZE * CONFIG.kv_size * 2
    monkeypatch.setattr(cache_module, "LOAD_CHUNK_BYTES", 3 * one_block)
    cache = KVCache(HotTier(CONFIG, 32, BLOCK_SIZE, torch.device(device), dtype), None)
    block_ids = (9, 3, 17, 4, 30, 11, 12, 25, 6)
    blocks = host_blocks(len(block_ids), pin=device == "cuda")
    expected = blocks.clone()
    writer = cache.prefix_writer(block_ids)
    writer.write(0, blocks[:5])
    writer.write(5, blocks[5:])
    writer.write(9, blocks[9:])  # an empty piece is nothing to do
    writer.finish()
    blocks.zero_()  # the host buffer is free once finish returns: the cache keeps what was written

    keys, values = cache.hot.keys.cpu(), cache.hot.values.cpu()
    for position, block_id in enumerate(block_ids):
        assert torch.equal(keys[:, block_id], expected[position, :, 0].to(dtype))
        assert torch.equal(values[:, block_id], expected[position, :, 1].to(dtype))
    untouched = [b for b in range(32) if b not in block_ids]
    assert not keys[:, untouched].any() and not values[:, untouched].any()
