"""Sampling: seeds make runs repeatable, filters keep the right tokens, params are validated."""

from __future__ import annotations

import pytest
import torch

from services.engine.execution.sampler import make_generator, sample
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, n: int) -> list[int]:
    generator = make_generator(seed, CPU)
    return [int(sample(logits, [params], [generator])[0]) for _ in range(n)]


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5, top_k=1)
    assert params.is_greedy
    assert sample(logits, [params] * 3, [None] * 3).tolist() == logits.argmax(-1).tolist()


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
    alone = sample(logits[1:], [params], [make_generator(7, CPU)])
    together = sample(logits, [params, params], [make_generator(99, CPU), make_generator(7, CPU)])
    assert int(together[1]) == int(alone[0])


def test_same_seed_same_output_in_the_engine(tiny_engine: LLMEngine) -> None:
    prompt = [5, 17, 42, 8]
    params = SamplingParams(
        max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    first = tiny_engine.generate([prompt], params)[0].token_ids
    batched = tiny_engine.generate([[9, 9, 9], prompt], [SamplingParams(temperature=1.0, seed=5), params])
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
