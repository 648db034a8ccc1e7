"""The fused prefix dequantization against kivi's reference: the same pages, bit for bit.

On the CPU it runs through Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest) at small
shapes; on a GPU at the same shapes, bf16 pages included.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import prefix_kernel
from services.engine.attention.paged_kernels import PagedLayer
from services.engine.attention.triton_backend import dequantize_prefix_reference
from services.engine.kv.cache import WarmTier
from services.engine.model.config import ModelConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _warm_layer(layer, layers, groups, group_size, block_size, heads, dim, gen) -> PagedLayer:
    config = ModelConfig(vocab_size=8, hidden_size=heads * dim, intermediate_size=8, num_layers=layers,
                         num_heads=heads, num_kv_heads=heads, head_dim=dim)  # fmt: skip
    warm = WarmTier(config, groups, group_size, torch.device("cpu"))
    for codes in (warm.key_codes, warm.value_codes):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.uint8))
    for params in (warm.key_scale, warm.value_scale):
        params.copy_((torch.rand(params.shape, generator=gen) * 0.3 + 1e-3).half())
    for params in (warm.key_zero, warm.value_zero):
        params.copy_((torch.randn(params.shape, generator=gen) * 2).half())
    warm.key_scale[layer, 0, 0, 1] = 1000.0  # a wide channel: products far from the codes' range
    views = warm.layer_views(layer, block_size)
    hot = torch.zeros(1, block_size, heads, dim)  # unread
    return PagedLayer(hot, hot, views, group_size // block_size)


@pytest.mark.parametrize(
    ("block_size", "group_size", "dim", "heads"),
    [(16, 32, 64, 2), (4, 16, 8, 1), (8, 8, 32, 3), (16, 16, 128, 1)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_prefix_dequantization_writes_the_reference_pages(block_size, group_size, dim, heads, dtype):
    """Every page 1..S equals the reference's for its block, bit for bit (blocks in any order, one
    repeated, the last layer's views); page 0 is left as it was."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("Triton's CPU interpreter has no bf16 arithmetic")
    gen = torch.Generator().manual_seed(dim + block_size)
    groups = 5
    layer = _warm_layer(1, 2, groups, group_size, block_size, heads, dim, gen)
    num_blocks = groups * group_size // block_size
    blocks = torch.randperm(num_blocks, generator=gen)[: num_blocks - 1]
    blocks = torch.cat([blocks, blocks[:1]])  # a block read twice is dequantized twice, the same
    shape = (blocks.shape[0] + 1, block_size, heads, dim)
    expected_keys = torch.full(shape, -3.0, dtype=dtype)
    expected_values = torch.full(shape, -3.0, dtype=dtype)
    dequantize_prefix_reference(layer, blocks, expected_keys, expected_values)

    warm = layer.warm
    assert warm is not None
    on_device = [t.to(DEVICE) for t in warm]
    keys = torch.full(shape, -3.0, dtype=dtype, device=DEVICE)
    values = torch.full(shape, -3.0, dtype=dtype, device=DEVICE)
    assert prefix_kernel.supports(on_device[0], keys)
    prefix_kernel.dequantize_prefix(
        *on_device, layer.blocks_per_group, blocks.to(torch.int32).to(DEVICE), keys, values
    )
    assert torch.equal(keys.cpu(), expected_keys)
    assert torch.equal(values.cpu(), expected_values)
    assert (keys[0] == -3.0).all()


def test_fused_prefix_dequantization_refuses_what_it_cannot_take():
    """A head dim that is not a power of two, or too few pages: a clear error, nothing written."""
    gen = torch.Generator().manual_seed(0)
    layer = _warm_layer(0, 1, 2, 16, 16, 1, 24, gen)
    warm = layer.warm
    assert warm is not None
    keys = torch.zeros(3, 16, 1, 24)
    assert not prefix_kernel.supports(warm.key_codes, keys)
    with pytest.raises(ValueError, match="head dim 24"):
        prefix_kernel.dequantize_prefix(*warm, 1, torch.tensor([0, 1]), keys, keys.clone())
    layer = _warm_layer(0, 1, 2, 16, 16, 1, 32, gen)
    warm = layer.warm
    assert warm is not None
    keys = torch.zeros(2, 16, 1, 32)
    with pytest.raises(ValueError, match="2 blocks need 3 pages"):
        prefix_kernel.dequantize_prefix(*warm, 1, torch.tensor([0, 1]), keys, keys.clone())
