"""Token budgets: one request's prompt plus max_tokens against its tenant's per-request limit."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gateway.budget import check_request_budget
from services.gateway.tenants import TenantLimits

LIMITS = TenantLimits(max_request_tokens=100, tokens_per_min=1000)


def test_a_request_at_its_budget_is_admitted_and_one_token_over_is_refused_with_both_counts() -> None:
    check_request_budget("acme", LIMITS, prompt_tokens=60, max_tokens=40, counted_by="a test")
    with pytest.raises(InvalidArgument, match=r"60 prompt tokens .* \+ 41 max_tokens = 101.* allows 100"):
        check_request_budget("acme", LIMITS, prompt_tokens=60, max_tokens=41, counted_by="a test")


def test_a_prompt_larger_than_the_token_bucket_can_never_be_admitted() -> None:
    limits = TenantLimits(max_request_tokens=5000, tokens_per_min=1000, burst_tokens=200)
    check_request_budget("acme", limits, prompt_tokens=200, max_tokens=10, counted_by="a test")
    with pytest.raises(InvalidArgument, match=r"201 tokens exceeds .* token bucket of 200"):
        check_request_budget("acme", limits, prompt_tokens=201, max_tokens=10, counted_by="a test")
