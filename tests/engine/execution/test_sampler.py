"""Sampling: seeds make runs repeatable, filters keep the right tokens, params are validated."""

from __future__ import annotations

import pytest
import torch

from services.engine.execution.sampler import FAULT, sample
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, n: int) -> list[int]:
    """The first n draws of one seeded request (token index 0..n-1)."""
    return [int(sample(logits, [params], [(seed, index)])[0]) for index in range(n)]


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5, top_k=1)
    assert params.is_greedy
    assert sample(logits, [params] * 3, [(0, 0)] * 3).tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_only_draw_allowed_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    top_k = set(_draw(logits, SamplingParams(temperature=5.0, top_k=2), seed=1, n=200))
    assert top_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # [0.64, 0.24, 0.09, ...]: 0.9 needs the first three
    assert probs[:2].sum() < 0.9 < probs[:3].sum()
    top_p = set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.9), seed=2, n=400))
    assert top_p == {0, 1, 2}


def test_rows_sample_independently_of_their_neighbours() -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    alone = [int(sample(logits[1:], [params], [(7, index)])[0]) for index in range(20)]
    together = [int(sample(logits, [params, params], [(99, index), (7, index)])[1]) for index in range(20)]
    assert together == alone
    assert len(set(alone)) > 1  # the draws move with the token index


PLAIN = SamplingParams(temperature=1.0)
TOP_K_5 = SamplingParams(temperature=1.0, top_k=5)
TOP_K_50 = SamplingParams(temperature=1.0, top_k=50)
TOP_P_09 = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.mark.parametrize(
    ("mine", "neighbour"),
    [
        (PLAIN, TOP_K_5),
        (PLAIN, TOP_P_09),
        (TOP_K_5, TOP_K_50),
        (TOP_K_5, TOP_P_09),
        (TOP_P_09, PLAIN),
        (TOP_P_09, TOP_K_5),
    ],
)
def test_a_seeded_row_ignores_its_neighbours_settings(
    mine: SamplingParams, neighbour: SamplingParams
) -> None:
    # whether the batch sorts, and how far (top-k alone: topk to the largest k), follows the neighbours
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    alone = [int(sample(logits[1:2], [mine], [(7, index)])[0]) for index in range(40)]
    beside = [
        sample(logits, [neighbour, mine, PLAIN], [(99, i), (7, i), (5, i)])[1].item() for i in range(40)
    ]
    assert beside == alone
    assert len(set(alone)) > 1


@pytest.mark.parametrize("tie", ["ten-way", "signed-zeros"])
def test_tied_logits_rank_the_same_whether_topk_or_sort_ranks_them(tie: str) -> None:
    logits = torch.zeros(2, 64)
    if tie == "ten-way":
        logits[:, 10:20] = 2.0  # ten tokens tie for first place; top-k=4 keeps the four lowest ids
    else:
        logits[:, 1::2] = -0.0  # -0.0 equals 0.0: every token ties
    top_k_4 = SamplingParams(temperature=1.0, top_k=4)
    by_topk = [sample(logits, [TOP_K_50, top_k_4], [(1, i), (2, i)])[1].item() for i in range(200)]
    by_sort = [sample(logits, [TOP_P_09, top_k_4], [(1, i), (2, i)])[1].item() for i in range(200)]
    assert by_topk == by_sort
    assert set(by_topk) == ({10, 11, 12, 13} if tie == "ten-way" else {0, 1, 2, 3})


def test_draws_follow_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8)
    draws = _draw(logits, params, seed=11, n=6000)
    expected = torch.softmax(logits[0] / 0.8, -1)
    observed = torch.bincount(torch.tensor(draws), minlength=5).double() / len(draws)
    assert torch.allclose(observed, expected.double(), atol=0.02), (observed, expected)


def test_a_mixed_batch_keeps_greedy_rows_greedy_and_faults_only_the_bad_row() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    logits[2, 7] = float("nan")
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=5)]  # fmt: skip
    drawn = sample(logits, params, [(1, 0), (2, 0), (3, 0), (4, 0)]).tolist()
    assert drawn[0] == int(logits[0].argmax())
    assert drawn[2] == FAULT
    assert 0 <= drawn[1] < 64
    assert drawn[3] in logits[3].topk(5).indices.tolist()


def test_same_seed_same_output_in_the_engine(tiny_engine: LLMEngine) -> None:
    prompt = [5, 17, 42, 8]
    params = SamplingParams(
        max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    first = tiny_engine.generate([prompt], params)[0].token_ids
    batched = tiny_engine.generate([[9, 9, 9], prompt], [SamplingParams(temperature=1.0, seed=5), params])
    plain = SamplingParams(max_new_tokens=24, temperature=1.0, seed=77, ignore_eos=True)
    plain_alone = tiny_engine.generate([prompt], plain)[0].token_ids
    beside_top_k = tiny_engine.generate(
        [[9, 9, 9], prompt], [SamplingParams(temperature=1.0, top_k=5), plain]
    )
    assert beside_top_k[1].token_ids == plain_alone
    other_seed = tiny_engine.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 4321}))[
        0
    ].token_ids
    assert batched[1].token_ids == first
    assert other_seed != first
    greedy = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    top_k_one = SamplingParams(max_new_tokens=24, temperature=0.7, top_k=1, seed=3, ignore_eos=True)
    assert tiny_engine.generate([prompt], top_k_one)[0].token_ids == greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be 0"),
        ({"temperature": float("nan")}, "temperature must be 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be in"),
        ({"seed": -5}, "seed must be in"),
        ({"stop": ("ok", "")}, "stop strings must be non-empty"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ],
)
def test_invalid_params_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_accepts_a_single_string_or_list() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]


def test_rows_with_different_top_k_each_keep_their_own() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -1.0]] * 2)
    params = [SamplingParams(temperature=5.0, top_k=2), SamplingParams(temperature=5.0, top_k=5)]
    draws = [sample(logits, params, [(3, index), (4, index)]).tolist() for index in range(300)]
    assert {row[0] for row in draws} == {0, 1}
    assert {row[1] for row in draws} == {0, 1, 2, 3, 4}
