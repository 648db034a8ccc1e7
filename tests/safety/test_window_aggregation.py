"""The window aggregation on hand-made window scores, and its manifest entry."""

from __future__ import annotations

import pytest
import torch

from services.common.gate_file import GateFileError
from services.safety.window_aggregation import WindowAggregation

THRESHOLD = 0.9


def _windows(*scores: float) -> torch.Tensor:
    return torch.tensor(scores)[:, None]  # [W, 1]: one category


def test_a_one_window_view_is_scored_by_its_window_under_every_rule() -> None:
    for rule in (WindowAggregation(), WindowAggregation(3, 2.0)):
        assert float(rule.view_scores(_windows(0.95))[0]) == pytest.approx(0.95)


def test_the_bare_maximum_lets_one_odd_window_flag_a_long_view() -> None:
    odd = _windows(0.93, *[0.01] * 40)
    assert float(WindowAggregation().view_scores(odd)[0]) >= THRESHOLD


def test_top_k_with_a_lone_window_margin_needs_dwelling_or_a_window_far_past_benign() -> None:
    rule = WindowAggregation(top_k=2, lone_window_margin=2.0)
    odd = _windows(0.93, *[0.01] * 40)  # one window just over the threshold
    assert float(rule.view_scores(odd)[0]) < THRESHOLD
    dwelling = _windows(0.95, 0.92, *[0.01] * 40)  # the text stays on the topic
    assert float(rule.view_scores(dwelling)[0]) >= THRESHOLD
    pasted = _windows(0.9995, *[0.01] * 40)  # a request far past what benign sentences reach
    assert float(rule.view_scores(pasted)[0]) >= THRESHOLD


def test_top_k_without_a_lone_window_rule_is_the_mean_of_the_top_windows() -> None:
    scores = WindowAggregation(top_k=2).view_scores(_windows(0.9995, 0.2, 0.1))
    assert float(scores[0]) == pytest.approx((0.9995 + 0.2) / 2)


def test_a_text_scores_the_highest_of_its_views_per_category() -> None:
    plain = torch.tensor([[0.2, 0.1]])
    decoded = torch.tensor([[0.1, 0.97]])
    scores = WindowAggregation(2, 1.0).text_scores([plain, decoded])
    assert scores.tolist() == pytest.approx([0.2, 0.97])


def test_the_manifest_entry_round_trips_and_a_gate_without_one_gets_the_bare_maximum() -> None:
    for rule in (WindowAggregation(3, 1.5), WindowAggregation(2)):
        assert WindowAggregation.from_manifest(rule.to_manifest()) == rule
    assert WindowAggregation.from_manifest(None).is_bare_max


@pytest.mark.parametrize("spec", [{"top_k": 0}, {"top_k": 2, "lone_window_margin": -1}, {"top_k": "2"}, [2]])
def test_a_bad_manifest_entry_is_refused(spec: object) -> None:
    with pytest.raises(GateFileError):
        WindowAggregation.from_manifest(spec)  # type: ignore[arg-type]
