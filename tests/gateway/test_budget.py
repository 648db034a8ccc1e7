"""Token budgets: one request's prompt plus max_tokens against its tenant's per-request limit and
token bucket, and what a caller whose reservation does not fit now is told."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gateway.budget import check_request_budget, refuse_reservation
from services.gateway.rate_limiter import RateDecision
from services.gateway.tenants import TenantLimits

LIMITS = TenantLimits(max_request_tokens=100, tokens_per_min=1000)


def test_a_request_at_its_budget_is_admitted_and_one_token_over_is_refused_with_both_counts() -> None:
    check_request_budget("acme", LIMITS, prompt_tokens=60, max_tokens=40, counted_by="a test")
    with pytest.raises(InvalidArgument, match=r"60 prompt tokens .* \+ 41 max_tokens = 101.* allows 100"):
        check_request_budget("acme", LIMITS, prompt_tokens=60, max_tokens=41, counted_by="a test")


def test_a_prompt_that_fills_the_token_bucket_can_never_be_admitted() -> None:
    limits = TenantLimits(max_request_tokens=5000, tokens_per_min=1000, burst_tokens=200)
    check_request_budget("acme", limits, prompt_tokens=199, max_tokens=1, counted_by="a test")
    with pytest.raises(InvalidArgument, match=r"200 tokens leaves no room .* token bucket of 200"):
        check_request_budget("acme", limits, prompt_tokens=200, max_tokens=1, counted_by="a test")


def test_a_prompt_plus_max_tokens_larger_than_the_bucket_can_never_be_admitted_and_says_what_fits() -> None:
    limits = TenantLimits(max_request_tokens=5000, tokens_per_min=1000, burst_tokens=200)
    check_request_budget("acme", limits, prompt_tokens=20, max_tokens=180, counted_by="a test")
    with pytest.raises(
        InvalidArgument, match=r"20 prompt tokens \+ 181 max_tokens = 201.*set max_tokens to at most 180"
    ):
        check_request_budget("acme", limits, prompt_tokens=20, max_tokens=181, counted_by="a test")


def test_a_reservation_that_does_not_fit_now_says_when_it_will_and_which_max_tokens_fits_now() -> None:
    limits = TenantLimits(tokens_per_min=300)
    decision = RateDecision(is_admitted=False, retry_after_ms=18_012, num_tokens_left=105.4)
    error = refuse_reservation("acme", limits, decision, prompt_tokens=5, max_tokens=190)
    assert "reserves 5 prompt tokens + 190 max_tokens = 195, and the bucket holds 105 now" in error.message
    assert "set max_tokens to at most 100 to run now, or retry after 18.1 s" in error.message
    assert dict(error.trailing_metadata)["retry-after-ms"] == "18012"


def test_a_reservation_refused_with_not_even_its_prompt_left_only_says_when_to_retry() -> None:
    decision = RateDecision(is_admitted=False, retry_after_ms=2_000, num_tokens_left=4.0)
    error = refuse_reservation(
        "acme", TenantLimits(tokens_per_min=300), decision, prompt_tokens=5, max_tokens=1
    )
    assert "max_tokens to at most" not in error.message and error.message.endswith("retry after 2 s")
