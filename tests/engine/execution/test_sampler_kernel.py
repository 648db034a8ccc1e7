"""The sampler's Triton kernels against the torch reference: the same token for every row.

On the CPU they run through Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest) at small
shapes and small blocks, so that every loop crosses blocks; on a GPU at the same shapes. On a GPU the
kernel's `exp` is libdevice's `expf`, the one PyTorch's CUDA `exp` calls, so there every token must
equal the reference's (and `test_libdevice_exp_is_torch_cuda_exp` checks that premise). The
interpreter's `exp` is numpy's, which differs from PyTorch's CPU `exp` by an ulp or so on a third of
inputs: there a draw may differ where its uniform lies that close to a boundary between two tokens,
and `_assert_draws_match` checks that each difference is such a one. Logits made only of 0 and
-10,000 give weights of exactly 2^scale_bits or 0 on every device, and are compared exactly everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the sampler's kernels need Triton")

from services.engine.execution import sampler
from services.engine.execution.sampler import FAULT, sample_fused, sample_reference
from services.engine.scheduling.sampling_params import MAX_SEED, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPSILON = 1e-6  # how far a uniform may move before a CPU draw that differs must be explained

PLAIN = SamplingParams(temperature=0.7)
HOT = SamplingParams(temperature=3.0)
TOP_K_3 = SamplingParams(temperature=1.0, top_k=3)
TOP_K_40 = SamplingParams(temperature=0.5, top_k=40)
TOP_P = SamplingParams(temperature=1.3, top_p=0.8)
BOTH = SamplingParams(temperature=0.9, top_k=40, top_p=0.6)
GREEDY = SamplingParams()
GREEDY_TOP_K_1 = SamplingParams(temperature=2.0, top_k=1)


def _logits(batch: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _keys(batch: int, draw: int = 0) -> list[tuple[int, int]]:
    return [(1000 + 17 * r, draw + r) for r in range(batch)]


def _fused(logits, params, keys, block) -> list[int]:
    return sample_fused(logits.to(DEVICE), params, keys, block=block).cpu().tolist()


def _reference_at(logits, params, keys, shift: float, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The reference's tokens with every uniform moved by `shift`."""
    uniform = sampler.uniform
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "uniform", lambda seeds, draws: uniform(seeds, draws) + shift)
        return sample_reference(logits, params, keys).tolist()


def _assert_draws_match(logits, params, keys, block, monkeypatch) -> None:
    """Every row draws the reference's token; on the CPU, or one the reference draws within EPSILON."""
    got = _fused(logits, params, keys, block)
    expected = sample_reference(logits, params, keys).tolist()
    differ = [r for r, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    if DEVICE.type == "cuda" or not differ:
        assert not differ, (
            f"rows {differ}: kernel {[got[r] for r in differ]}, reference {[expected[r] for r in differ]}"
        )
        return
    assert len(differ) <= max(1, len(got) // 100), f"{len(differ)} of {len(got)} draws differ: not ulps"
    below = _reference_at(logits, params, keys, -EPSILON, monkeypatch)
    above = _reference_at(logits, params, keys, EPSILON, monkeypatch)
    for r in differ:
        assert got[r] in (below[r], above[r]), f"row {r}: {got[r]} is not near {expected[r]}'s boundary"


MIXES = {
    "temperature": [PLAIN, HOT],
    "top-k": [TOP_K_3, TOP_K_40],  # topk ranks 40 wide
    "top-p": [TOP_P, BOTH],  # a full stable sort
    "mixed": [GREEDY, PLAIN, TOP_K_3, TOP_P, BOTH, GREEDY_TOP_K_1],
}


@pytest.mark.parametrize("mix", MIXES, ids=str)
@pytest.mark.parametrize(("vocab", "block"), [(300, 64), (777, 256)], ids=str)
def test_kernel_draws_the_reference_token(mix, vocab, block, monkeypatch) -> None:
    batch = 60
    logits = _logits(batch, vocab, seed=vocab)
    params = [MIXES[mix][r % len(MIXES[mix])] for r in range(batch)]
    _assert_draws_match(logits, params, _keys(batch), block, monkeypatch)
    assert len(set(sample_reference(logits, params, _keys(batch)).tolist())) > batch // 3  # rows differ


def _flat(batch: int, vocab: int, kept_ids: list[list[int]]) -> torch.Tensor:
    """Logits 0 at each row's kept ids and -10,000 elsewhere: weights exactly 2^scale_bits or 0."""
    logits = torch.full((batch, vocab), -1e4)
    for row, ids in enumerate(kept_ids):
        logits[row, ids] = 0.0
    return logits


@pytest.mark.parametrize("mix", MIXES, ids=str)
def test_exact_weights_draw_exactly_the_reference_token(mix) -> None:
    """Each row keeps its own ids, spread over blocks, so a row that read a neighbour's logits, ranked
    ties other than by id, or kept more than its top-k or top-p would draw an id it may not."""
    batch, vocab, block = 48, 200, 32
    gen = torch.Generator().manual_seed(7)
    kept_ids = [
        torch.randperm(vocab, generator=gen)[: 5 + r % 40].sort().values.tolist() for r in range(batch)
    ]
    logits = _flat(batch, vocab, kept_ids)
    params = [MIXES[mix][r % len(MIXES[mix])] for r in range(batch)]
    got = _fused(logits, params, _keys(batch), block)
    assert got == sample_reference(logits, params, _keys(batch)).tolist()
    for token, ids, p in zip(got, kept_ids, params, strict=True):
        allowed = ids[: p.top_k] if p.top_k else ids  # ties: the lowest ids
        if p.top_p < 1.0:  # kept while the mass before is below p (fp32, as the row's setting is)
            allowed = allowed[: math.ceil(torch.tensor(p.top_p).item() * len(allowed))]
        assert token in (ids[:1] if p.is_greedy else allowed)


@pytest.mark.parametrize(("seed", "draw"), [(0, 0), (1, 2**40), (MAX_SEED, 3), (2**62 + 5, 2**31)], ids=str)
def test_uniform_hash_matches_at_the_ends_of_the_seed_range(seed, draw) -> None:
    """A flat 4096-token row draws floor(u * 4096): twelve bits of each uniform, compared exactly."""
    logits = torch.zeros(8, 4096)
    keys = [(seed, draw + r) for r in range(8)]
    got = _fused(logits, [PLAIN] * 8, keys, 1024)
    assert got == sample_reference(logits, [PLAIN] * 8, keys).tolist()
    expected = sampler.uniform(torch.tensor([seed] * 8), torch.tensor([d for _, d in keys])) * 4096
    assert got == expected.long().tolist()


@pytest.mark.parametrize("mine", [PLAIN, TOP_K_3, TOP_P, BOTH], ids=["plain", "top-k", "top-p", "both"])
def test_a_row_draws_the_same_token_whatever_its_neighbours(mine) -> None:
    """Alone, beside rows that make the batch topk 40 wide or sort it, at another batch position."""
    logits = _logits(5, 300, seed=11)
    keys = [(5, 9), (6, 9), (7, 9), (8, 9), (9, 9)]
    alone = [_fused(logits[2:3], [mine], [keys[2]], 64)[0] for _ in range(2)]
    beside_top_k = _fused(logits, [TOP_K_40, GREEDY, mine, TOP_K_3, PLAIN], keys, 64)[2]
    beside_sort = _fused(logits, [TOP_P, HOT, mine, GREEDY, TOP_K_40], keys, 64)[2]
    moved = _fused(logits[[2, 0, 1]], [mine, TOP_P, PLAIN], [keys[2], keys[0], keys[1]], 64)[0]
    assert alone[0] == alone[1] == beside_top_k == beside_sort == moved
    draws = {_fused(logits[2:3], [mine], [(5, d)], 64)[0] for d in range(12)}
    assert len(draws) > 1  # the draw index moves the uniform


@pytest.mark.parametrize("tie", ["ten-way", "signed-zeros"])
def test_tied_logits_rank_by_id_under_topk_and_sort(tie) -> None:
    """Ties spread over blocks of 16: topk's own order of tied values must not leak into the draw."""
    logits = torch.full((2, 64), -3.0)
    if tie == "ten-way":
        logits[:, [3, 14, 17, 30, 31, 33, 47, 50, 58, 63]] = 2.0  # top-k 4 keeps 3, 14, 17 and 30
        expected = {3, 14, 17, 30}
    else:
        logits[:, 0::2], logits[:, 1::2] = 0.0, -0.0  # -0.0 equals 0.0: every token ties
        expected = {0, 1, 2, 3}
    top_k_4 = SamplingParams(temperature=1.0, top_k=4)
    draws = 24  # pairs of rows: a neighbour that picks the ranking, then the top-k 4 row
    pairs = logits.repeat(draws, 1)
    keys = [(1 + r % 2, r // 2) for r in range(2 * draws)]
    by_topk = _fused(pairs, [TOP_K_40, top_k_4] * draws, keys, 16)[1::2]
    by_sort = _fused(pairs, [TOP_P, top_k_4] * draws, keys, 16)[1::2]
    assert by_topk == by_sort == sample_reference(pairs, [TOP_P, top_k_4] * draws, keys)[1::2].tolist()
    assert set(by_topk) == expected


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's 1e36 / 1e-3
def test_bad_rows_fault_alone() -> None:
    """NaN, +inf and -inf logits fault any row; a temperature that overflows a logit faults a sampled
    row, while a greedy one over the same logits takes its argmax."""
    logits = _logits(8, 100, seed=5)
    logits[0, 40], logits[1, 99], logits[2, 0] = float("nan"), float("inf"), float("-inf")
    logits[3:5, 60] = 1e36  # / 1e-3 overflows fp32
    cold = SamplingParams(temperature=1e-3)
    params = [PLAIN, TOP_P, TOP_K_3, cold, GREEDY, GREEDY, PLAIN, TOP_K_40]
    logits[5, 70] = float("nan")
    got = _fused(logits, params, _keys(8), 32)
    assert got == sample_reference(logits, params, _keys(8)).tolist()
    assert [t == FAULT for t in got] == [True, True, True, True, False, True, False, False]
    assert got[4] == 60


def test_greedy_rows_take_the_lowest_id_of_the_largest_logit() -> None:
    logits = _logits(3, 100, seed=2)
    logits[:, [70, 5, 90]] = 50.0  # three-way tie for the largest, across blocks of 32
    got = _fused(logits, [GREEDY, GREEDY_TOP_K_1, PLAIN], _keys(3), 32)
    assert got[:2] == [5, 5] == logits[:2].argmax(dim=-1).tolist()
    assert got[2] in (5, 70, 90)


def test_wrapper_refuses_settings_of_the_wrong_shape() -> None:
    from services.engine.execution import sampler_kernel

    logits = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="settings must be contiguous int64"):
        sampler_kernel.draw(logits, torch.zeros(3, 6, dtype=torch.int64, device=DEVICE), None, None, 40)
    with pytest.raises(ValueError, match="logits must be fp32"):
        sampler_kernel.draw(logits.T, torch.zeros(10, 6, dtype=torch.int64, device=DEVICE), None, None, 40)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="libdevice is CUDA's; the interpreter uses numpy's exp")
def test_libdevice_exp_is_torch_cuda_exp() -> None:
    """The premise of exact CUDA draws: the kernel's exp is bit for bit the one torch.exp runs."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def exp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, libdevice.exp(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)

    x = -torch.rand(1 << 22, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)) * 100
    out = torch.empty_like(x)
    exp_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out.view(torch.int32), torch.exp(x).view(torch.int32))
