"""The token-bucket script against a real redis-server: refill after idling, and the burst cap.

A tenant "idles" by having its bucket's last-update time moved back: the script reads that time
and Redis's own clock, so the test needs no sleep and no fast machine. The rates are so low
(one request per 1000 s) that the test's own run time adds less than a hundredth of a request.
"""

from __future__ import annotations

import asyncio
import uuid

import redis

from services.gateway.rate_limiter import RateLimiter, bucket_keys
from services.gateway.tenants import TenantLimits

BURST = 5
LIMITS = TenantLimits(requests_per_s=0.001, burst_requests=BURST, tokens_per_min=1, burst_tokens=100)


def _idle(url: str, key: str, seconds: float) -> None:
    """Moves the bucket's last update `seconds` into the past, as if the tenant had been idle."""
    client = redis.Redis.from_url(url)
    at_us = int(client.hget(key, "at_us") or 0)
    client.hset(key, "at_us", at_us - int(seconds * 1e6))


async def _count_admitted_requests(limiter: RateLimiter, tenant: str, attempts: int) -> int:
    decisions = [await limiter.take_request(tenant, LIMITS) for _ in range(attempts)]
    return sum(d.is_admitted for d in decisions)


def test_an_idle_tenant_refills_at_its_rate_and_never_beyond_its_burst(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> list[int]:
        limiter = RateLimiter(redis_url, timeout_s=2.0)
        try:
            admitted = [await _count_admitted_requests(limiter, tenant, 3 * BURST)]  # a new tenant: full
            _idle(redis_url, requests_key, 3600)  # 3.6 requests' worth at 0.001/s
            admitted.append(await _count_admitted_requests(limiter, tenant, 3 * BURST))
            _idle(redis_url, requests_key, 10 * 3600)  # 36 requests' worth, capped at the burst
            admitted.append(await _count_admitted_requests(limiter, tenant, 3 * BURST))
            return admitted
        finally:
            await limiter.close()

    assert asyncio.run(scenario()) == [BURST, 3, BURST]


def test_the_token_bucket_refills_and_caps_at_burst_tokens(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    tokens_key = bucket_keys(tenant)[1]

    async def scenario() -> list[bool]:
        limiter = RateLimiter(redis_url, timeout_s=2.0)
        try:
            outcomes = [(await limiter.take_tokens(tenant, LIMITS, 100)).is_admitted]  # the whole bucket
            outcomes.append((await limiter.take_tokens(tenant, LIMITS, 1)).is_admitted)  # empty
            _idle(redis_url, tokens_key, 30 * 60)  # 30 tokens' worth at 1 token/min
            outcomes.append((await limiter.take_tokens(tenant, LIMITS, 30)).is_admitted)
            outcomes.append((await limiter.take_tokens(tenant, LIMITS, 1)).is_admitted)
            _idle(redis_url, tokens_key, 24 * 3600)  # a day's worth, capped at burst_tokens
            outcomes.append((await limiter.take_tokens(tenant, LIMITS, 101)).is_admitted)
            outcomes.append((await limiter.take_tokens(tenant, LIMITS, 100)).is_admitted)
            return outcomes
        finally:
            await limiter.close()

    assert asyncio.run(scenario()) == [True, False, True, False, False, True]


def test_a_tenant_in_token_debt_is_refused_its_next_request(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[bool, int]:
        limiter = RateLimiter(redis_url, timeout_s=2.0)
        try:
            await limiter.charge_tokens(tenant, LIMITS, 150)  # a completion longer than the bucket
            decision = await limiter.take_request(tenant, LIMITS)
            return decision.is_admitted, decision.retry_after_ms
        finally:
            await limiter.close()

    is_admitted, retry_after_ms = asyncio.run(scenario())
    assert not is_admitted and retry_after_ms > 0
