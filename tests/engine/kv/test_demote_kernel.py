"""The fused demotion kernel against kivi's reference quantizer: the same codes, scales and zeros.

On the CPU it runs through Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest) at small
shapes; on a GPU at the same shapes, bf16 included.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.kv import kivi
from services.engine.kv.demote_kernel import demote

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pools(layers, blocks, block_size, heads, dim, groups, group_size, dtype, gen):
    hot_keys = (torch.randn(layers, blocks, block_size, heads, dim, generator=gen) * 3).to(dtype)
    hot_values = torch.randn(layers, blocks, block_size, heads, dim, generator=gen).to(dtype)
    hot_keys[0, 1, 0, 0, :4] = 40.0  # an outlier channel: a wide key scale
    hot_values[0, 2, :, 0, :] = 0.5  # a constant value group: its scale clamps to the floor
    value_groups = dim // min(group_size, dim)
    codes = torch.full((layers, groups, group_size, heads, dim // 2), 0xAB, dtype=torch.uint8)
    key_params = torch.full((layers, groups, heads, dim), -7.0, dtype=torch.float16)
    value_params = torch.full((layers, groups, group_size, heads, value_groups), -7.0, dtype=torch.float16)
    return hot_keys, hot_values, codes, key_params, value_params


@pytest.mark.parametrize(
    ("block_size", "group_size", "dim", "heads"),
    [(16, 32, 64, 2), (4, 16, 8, 1), (8, 8, 32, 3), (16, 16, 128, 1)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_demotion_writes_the_reference_quantization(block_size, group_size, dim, heads, dtype):
    """Every demoted group equals kivi's quantization of the same hot blocks, bit for bit; groups not
    demoted are left as they were."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("Triton's CPU interpreter has no bf16 arithmetic")
    gen = torch.Generator().manual_seed(block_size + dim)
    layers, blocks, groups = 2, 16, 5
    hot_keys, hot_values, codes, key_params, value_params = _pools(
        layers, blocks, block_size, heads, dim, groups, group_size, dtype, gen
    )
    per_group = group_size // block_size
    # three demotions: out-of-order blocks, into groups 3, 0 and 4 (1 and 2 stay untouched)
    order = torch.randperm(blocks - 1, generator=gen)[: 3 * per_group] + 1
    block_ids = order.view(3, per_group).to(torch.int32)
    group_ids = torch.tensor([3, 0, 4], dtype=torch.int32)
    pools = [codes.clone(), key_params.clone(), key_params.clone(), codes.clone(), value_params.clone(),
             value_params.clone()]  # fmt: skip
    on_device = [t.to(DEVICE) for t in pools]
    demote(hot_keys.to(DEVICE), hot_values.to(DEVICE), block_ids.to(DEVICE), group_ids.to(DEVICE), *on_device)
    got = [t.cpu() for t in on_device]

    expected = [t.clone() for t in pools]
    keys = hot_keys[:, block_ids.long()].flatten(2, 3)  # [L, 3, G, KVH, D]
    values = hot_values[:, block_ids.long()].flatten(2, 3)
    qk = kivi.quantize_keys(keys)
    qv = kivi.quantize_values(values, group_size)
    index = group_ids.long()
    for tensor, part in zip(expected, (*qk, *qv), strict=True):
        tensor[:, index] = part
    names = ("key codes", "key scale", "key zero", "value codes", "value scale", "value zero")
    for name, g, e in zip(names, got, expected, strict=True):
        assert torch.equal(g, e), f"{name} differ at {(g != e).nonzero()[:4].tolist()}"


def test_a_tie_rounds_to_even_as_the_reference_does():
    """Positions exactly halfway between two codes round to the even one (torch.round)."""
    keys = torch.zeros(1, 3, 4, 1, 8)  # [L, blocks, BS, KVH, D]; block 0 is scratch
    ramp = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 7.5, 14.5, 3.0])  # scale 1: x.5 are ties
    keys[0, 1:].view(8, 8)[:] = ramp[:, None]
    values = keys.clone()
    codes = torch.zeros(1, 1, 8, 1, 4, dtype=torch.uint8)
    key_params = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    value_params = torch.zeros(1, 1, 8, 1, 1, dtype=torch.float16)
    pools = [codes.clone(), key_params.clone(), key_params.clone(), codes.clone(), value_params.clone(),
             value_params.clone()]  # fmt: skip
    on_device = [t.to(DEVICE) for t in pools]
    ids = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    group = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    demote(keys.to(DEVICE), values.to(DEVICE), ids, group, *on_device)
    reference = kivi.quantize_keys(keys[:, 1:3].reshape(1, 1, 8, 1, 8))
    assert torch.equal(on_device[0].cpu(), reference.codes)
    assert kivi.unpack_int4(on_device[0].cpu())[0, 0, :, 0, 0].tolist() == [0, 15, 0, 2, 2, 8, 14, 3]
