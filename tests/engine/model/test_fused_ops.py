"""The fused Triton kernels of the small decoder ops against their torch references (on the CPU through
Triton's interpreter; on a GPU natively), and a tiny model whose greedy output is unchanged by them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine
from services.engine.model import fused_ops
from services.engine.scheduling.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding step apart at most
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rmsnorm_matches_the_reference(dtype: torch.dtype, hidden: int) -> None:
    x, residual = _randn(5, hidden, dtype=dtype, seed=0), _randn(5, hidden, dtype=dtype, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2)
    out, stream = fused_ops.add_rmsnorm(x, residual, weight, 1e-5)
    expected_out, expected_stream = fused_ops.add_rmsnorm_reference(x, residual, weight, 1e-5)
    assert torch.equal(stream, expected_stream)  # the add rounds exactly as the torch add
    _close(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 8), (2, 2, 12)])
def test_rotary_and_store_matches_the_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens, positions_total, blocks, block_size = 6, 40, 5, 4
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    angles = _randn(positions_total, head_dim, dtype=torch.float32, seed=4)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 7, 39, 3, 3, 21], device=DEVICE)
    slots = torch.tensor([5, 9, 0, 19, 12, 1], device=DEVICE)
    caches = [
        torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)
    ]
    q, k, v = fused_ops.rotary_and_store(
        qkv.clone(), heads, kv_heads, cos, sin, positions, caches[0], caches[1], slots
    )
    eq, ek, ev = fused_ops.rotary_and_store_reference(
        qkv.clone(), heads, kv_heads, cos, sin, positions, caches[2], caches[3], slots
    )
    _close(q, eq)
    _close(k, ek)
    assert torch.equal(v, ev)
    _close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0  # the keys did land in the cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_mul_matches_the_reference(dtype: torch.dtype, width: int) -> None:
    gate_up = _randn(3, 2 * width, dtype=dtype, seed=5) * 4
    _close(fused_ops.silu_mul(gate_up), fused_ops.silu_mul_reference(gate_up))


def test_greedy_output_is_the_same_with_the_fused_ops(tiny_dir: Path) -> None:
    engine = LLMEngine.load(
        tiny_dir, device=DEVICE, dtype="float32", max_batch_size=3, max_seq_len=128, cuda_graphs=False,
        kv=KVCacheSpec(num_hot_blocks=64), progress=False,
    )  # fmt: skip
    engine.runner.model.use_fused_ops(False)  # on CUDA the runner turned them on
    prompts = [[5, 9, 2, 44, 17], [3] * 20, [100, 7]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reference = [r.token_ids for r in engine.generate(prompts, params)]
    engine.runner.model.use_fused_ops(True)
    fused = [r.token_ids for r in engine.generate(prompts, params)]
    assert fused == reference
