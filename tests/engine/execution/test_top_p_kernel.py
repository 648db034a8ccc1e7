"""The top-p-only draw (top_p_kernel, through `sample_fused`) against the torch reference's full sort.

Such a row sorts its candidates in its program when at most `max_candidates` tokens score at least its
last kept rank, and takes the sort-free path otherwise. The tests make `max_candidates` small, so that
both run, and each case checks that it took the paths it is meant to. On the CPU, draws that differ
from the reference's are judged as in test_sampler_kernel (the interpreter's exp is numpy's); the two
paths share the kernel's exp, so they must agree with each other exactly everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import cycle, islice, product
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton", reason="the sampler's kernels need Triton")

from services.engine.execution import sampler
from services.engine.execution.sampler import FAULT, sample_reference
from services.engine.scheduling.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from tests.engine.execution.test_sampler_kernel import _assert_draws_match, _flat, _fused, _keys, _logits

SORTED, SORT_FREE = "sorted in the program", "sort-free"


def _top_p_rows(temperatures: list[float], top_ps: list[float], batch: int) -> list[SamplingParams]:
    combos = list(product(temperatures, top_ps))
    return [SamplingParams(temperature=t, top_p=p) for t, p in islice(cycle(combos), batch)]


def _num_through_last_kept(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """Per row, how many tokens score at least the reference's last kept rank: the candidates a row
    sorts in its program if they fit in `max_candidates`."""
    temperature = torch.tensor([p.temperature for p in params])  # fp32, as the reference's
    top_p = torch.tensor([p.top_p for p in params])
    scaled = logits / temperature[:, None]  # [B, V]
    ranked = scaled.sort(dim=-1, descending=True).values
    weights = sampler._weights(ranked, sampler._scale_bits(logits.shape[-1]))
    cumulative = weights.cumsum(dim=-1)
    within_p = (cumulative - weights).double() < top_p[:, None].double() * cumulative[:, -1:].double()
    last_kept = ranked.gather(1, within_p.sum(dim=-1, keepdim=True).clamp(min=1) - 1)  # [B, 1]
    return (scaled >= last_kept).sum(dim=-1).tolist()


def _paths(logits: torch.Tensor, params: list[SamplingParams], max_candidates: int) -> set[str]:
    return {SORTED if n <= max_candidates else SORT_FREE for n in _num_through_last_kept(logits, params)}


def _half_steps(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits on a grid of 0.5 from about -6 to 6: every rank ties with many others."""
    return (_logits(batch, vocab, seed, scale=2.0) * 2).round() / 2


def _tied_best(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Gaussian logits whose largest value is shared by 2-4 ids, spread over the row."""
    logits = _logits(batch, vocab, seed)
    for row in range(batch):
        ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + row))[: 2 + row % 3]
        logits[row, ids] = logits[row].max() + 1.0
    return logits


def _mostly_masked(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Nine in ten logits at -10,000 (a masked token: weight 0), the rest Gaussian."""
    logits = _logits(batch, vocab, seed)
    masked = torch.rand(batch, vocab, generator=torch.Generator().manual_seed(seed)) < 0.9
    return logits.masked_fill(masked, -1e4)


class Case(NamedTuple):
    """Top-p-only rows of one kind (every temperature with every top-p), and the paths they must take
    at `max_candidates`."""

    make_logits: Callable[[int, int, int], torch.Tensor]
    temperatures: list[float]
    top_ps: list[float]
    batch: int
    vocab: int
    block: int
    max_candidates: int
    paths: set[str]


BOTH = {SORTED, SORT_FREE}
CASES = {  # logits, temperatures, top-ps, batch, vocab, block, max_candidates, paths
    "gaussian": Case(_logits, [0.3, 0.8, 1.3, 3.0], [0.5, 0.9, 0.97], 12, 777, 64, 16, BOTH),
    "half-step ties": Case(_half_steps, [1.0, 0.5], [0.3, 0.7, 0.9, 0.99], 16, 500, 64, 16, BOTH),
    "flat and hot": Case(_logits, [MAX_TEMPERATURE, 30.0], [0.5, 0.9], 8, 1000, 256, 16, {SORT_FREE}),
    "cold, tied best": Case(_tied_best, [MIN_TEMPERATURE, 0.05], [0.9, 0.2], 8, 300, 64, 2, BOTH),
    "tiny top-p": Case(_half_steps, [1.0], [1e-7, 1e-45, 1e-50], 9, 300, 64, 16, {SORTED}),
    "top-p near 1": Case(_logits, [0.7, 2.0], [0.9999999, 1 - 1e-12], 8, 300, 64, 16, {SORT_FREE}),
    "mostly masked": Case(_mostly_masked, [1.5, 4.0], [0.8, 0.95], 12, 400, 32, 8, BOTH),
    "whole row sorted": Case(_logits, [0.5, 1.0, 4.0], [0.6, 0.95], 12, 50, 16, 64, {SORTED}),
    "a few thousand": Case(_logits, [0.8, 1.5], [0.9, 0.95], 6, 3000, 512, 32, BOTH),
}


@pytest.mark.parametrize("name", CASES, ids=str)
def test_top_p_rows_draw_the_reference_token(name, monkeypatch) -> None:
    case = CASES[name]
    logits = case.make_logits(case.batch, case.vocab, case.vocab + len(name))
    params = _top_p_rows(case.temperatures, case.top_ps, case.batch)
    assert _paths(logits, params, case.max_candidates) == case.paths
    keys = _keys(case.batch, draw=len(name))
    _assert_draws_match(logits, params, keys, case.block, monkeypatch, case.max_candidates)


def test_tiny_top_p_keeps_the_lowest_id_of_the_best() -> None:
    logits = _tied_best(6, 300, seed=3)
    params = _top_p_rows([1.0, MIN_TEMPERATURE], [1e-7, 1e-50], 6)
    lowest = [(row == row.max()).nonzero()[0].item() for row in logits]
    assert _fused(logits, params, _keys(6), 64, 4) == lowest


def test_exact_weights_draw_exactly_the_reference_token() -> None:
    """Each row keeps 1-24 ids of equal weight (logits 0.0 and -0.0, which tie; -10,000 elsewhere),
    spread over blocks: one tie that top-p cuts at ceil(top_p * n) ids, lowest first. Compared exactly,
    on the CPU too."""
    batch, vocab, block, max_candidates = 24, 200, 32, 8
    gen = torch.Generator().manual_seed(8)
    kept_ids = [torch.randperm(vocab, generator=gen)[: 1 + r].sort().values.tolist() for r in range(batch)]
    logits = _flat(batch, vocab, kept_ids)
    logits[:, 1::2] = torch.where(logits[:, 1::2] == 0.0, -0.0, logits[:, 1::2])
    params = _top_p_rows([0.7, 1.0, 20.0], [0.1, 0.5, 0.9, 0.99], batch)
    assert _paths(logits, params, max_candidates) == BOTH
    keys = _keys(batch, draw=5)
    got = _fused(logits, params, keys, block, max_candidates)
    assert got == sample_reference(logits, params, keys).tolist()
    for token, ids, p in zip(got, kept_ids, params, strict=True):
        assert token in ids[: math.ceil(torch.tensor(p.top_p).item() * len(ids))]


@pytest.mark.parametrize("max_candidates", [1, 8], ids=[SORT_FREE, SORTED])
def test_a_top_p_reached_exactly_keeps_no_more(max_candidates) -> None:
    """n tied ids and top_p = k / n exactly: the mass before the (k+1)-th id equals the threshold, which
    is not below it, so the reference keeps k ids and every draw must be one of the k lowest."""
    n_and_top_p = [(2, 0.5), (4, 0.5), (8, 0.25), (8, 0.75)]  # keeps 1, 2, 2 and 6
    draws, vocab = 6, 100
    gen = torch.Generator().manual_seed(3)
    kept_ids = [torch.randperm(vocab, generator=gen)[:n].sort().values.tolist() for n, _ in n_and_top_p]
    logits = _flat(len(kept_ids), vocab, kept_ids).repeat_interleave(draws, dim=0)
    params = [SamplingParams(temperature=0.9, top_p=p) for _, p in n_and_top_p for _ in range(draws)]
    keys = [(7, d) for _ in n_and_top_p for d in range(draws)]
    got = _fused(logits, params, keys, 32, max_candidates)
    assert got == sample_reference(logits, params, keys).tolist()
    for case, (n, top_p) in enumerate(n_and_top_p):
        assert set(got[case * draws : (case + 1) * draws]) <= set(kept_ids[case][: int(n * top_p)])


@pytest.mark.parametrize("make_logits", [_logits, _half_steps], ids=["gaussian", "half-step ties"])
def test_both_paths_draw_the_same_token(make_logits) -> None:
    """The same rows and uniforms through the sort and through the sort-free path: exactly equal
    everywhere, since the two share the kernel's exp (32 candidates hold the whole row)."""
    batch, vocab = 12, 32
    logits = make_logits(batch, vocab, 17)
    params = _top_p_rows([0.5, 1.0, 2.5], [0.4, 0.8, 0.95, 0.999], batch)
    keys = _keys(batch, draw=40)
    sort_free = _fused(logits, params, keys, 16, max_candidates=1)
    assert _fused(logits, params, keys, 16, max_candidates=32) == sort_free
    assert len(set(sort_free)) > batch // 3


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_top_p_rows_beside_every_other_kind_and_bad_rows(monkeypatch) -> None:
    """Greedy, by id, top-k, top-k + top-p, and top-p alone on both paths, in one batch, where NaN,
    +inf and -inf logits fault the top-p rows that hold them and no other."""
    top_p, hot_top_p = SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=50.0, top_p=0.9)
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.6),
        top_p,
        hot_top_p,
    ]
    batch, vocab = 24, 300
    params = [kinds[r % len(kinds)] for r in range(batch)]
    logits = _logits(batch, vocab, seed=23)
    bad = {4: float("nan"), 5: float("inf"), 10: float("-inf")}  # top-p rows, one on each path
    for row, value in bad.items():
        logits[row, 77] = value
    clean = [r for r in range(batch) if r not in bad and params[r].top_p < 1.0 and not params[r].top_k]
    assert _paths(logits[clean], [params[r] for r in clean], 16) == BOTH
    _assert_draws_match(logits, params, _keys(batch), 64, monkeypatch)  # a FAULT row must match exactly
    faults = sample_reference(logits, params, _keys(batch)) == FAULT
    assert faults.nonzero().flatten().tolist() == sorted(bad)
