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


def _level(url: str, key: str) -> float:
    return float(redis.Redis.from_url(url).hget(key, "level") or "nan")


async def _call(limiter: RateLimiter, tenant: str, limits: TenantLimits = LIMITS) -> None:
    """One call as the gatekeeper charges it: its request, then its prompt's token (which leases
    a request for the next call when the limiter leases)."""
    await limiter.take_request(tenant, limits)
    await limiter.take_tokens(tenant, limits, 1)


def test_a_lease_is_taken_from_the_bucket_and_spent_without_redis(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> list[object]:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            seen: list[object] = [(await limiter.take_request(tenant, LIMITS)).is_admitted]
            seen.append((await limiter.take_tokens(tenant, LIMITS, 1)).is_admitted)
            seen += [limiter.holds_lease(tenant), round(_level(redis_url, requests_key))]  # 5 - 1 - 1
            redis.Redis.from_url(redis_url).delete(requests_key)  # the lease must not need the bucket
            redis.Redis.from_url(redis_url).hset(requests_key, mapping={"level": "0", "at_us": 2**62})
            seen.append((await limiter.take_request(tenant, LIMITS)).is_admitted)
            seen += [limiter.holds_lease(tenant), (await limiter.take_request(tenant, LIMITS)).is_admitted]
            return seen
        finally:
            await limiter.close()

    assert asyncio.run(scenario()) == [True, True, True, 3, True, False, False]


def test_the_replicas_together_never_admit_more_than_the_bucket(redis_url: str) -> None:
    """Two limiters (two gateways) alternate calls of one tenant; each call is a request then its
    prompt tokens, as the gatekeeper charges them. Leases shift when a request is taken, never
    how many."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def scenario() -> int:
        replicas = [RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60) for _ in range(2)]
        admitted = 0
        try:
            for attempt in range(4 * BURST):
                limiter = replicas[attempt % 2]
                if (await limiter.take_request(tenant, LIMITS)).is_admitted:
                    admitted += (await limiter.take_tokens(tenant, LIMITS, 1)).is_admitted
            return admitted
        finally:
            for limiter in replicas:
                await limiter.close()

    assert asyncio.run(scenario()) == BURST


def test_a_lease_not_spent_goes_back_to_the_bucket(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> list[float]:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            await _call(limiter, tenant)
            levels = [_level(redis_url, requests_key)]
        finally:
            await limiter.close()  # gives held leases back, as a gateway that stops does
        return [*levels, _level(redis_url, requests_key)]

    held, given_back = asyncio.run(scenario())
    assert round(held) == BURST - 2 and round(given_back) == BURST - 1


def test_a_full_bucket_takes_no_more_back_than_its_burst(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> float:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            await _call(limiter, tenant)
            _idle(redis_url, requests_key, 10 * 3600)  # refilled to the burst while the lease is held
        finally:
            await limiter.close()
        return _level(redis_url, requests_key)

    assert asyncio.run(scenario()) == BURST


def test_no_lease_is_taken_from_the_last_request_in_the_bucket(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    limits = TenantLimits(requests_per_s=0.001, burst_requests=2, tokens_per_min=1, burst_tokens=100)

    async def scenario() -> list[bool]:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            await _call(limiter, tenant, limits)  # leaves 1
            return [limiter.holds_lease(tenant), (await limiter.take_request(tenant, limits)).is_admitted]
        finally:
            await limiter.close()

    assert asyncio.run(scenario()) == [False, True]


def test_concurrent_calls_of_a_tenant_lease_one_request_between_them(redis_url: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> float:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            await asyncio.gather(*(limiter.take_tokens(tenant, LIMITS, 1) for _ in range(4)))
            return _level(redis_url, requests_key)
        finally:
            await limiter.close()

    assert round(asyncio.run(scenario())) == BURST - 1  # one lease out of five requests, not four


def test_a_lease_held_past_its_hold_time_goes_back_on_its_own(redis_url: str) -> None:
    """The expiry timer's callback (run here directly rather than waited for) returns the lease
    to the bucket in the background, and the next call takes from the bucket again."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    requests_key = bucket_keys(tenant)[0]

    async def scenario() -> list[object]:
        limiter = RateLimiter(redis_url, timeout_s=2.0, lease_hold_s=60)
        try:
            await _call(limiter, tenant)
            seen: list[object] = [limiter.holds_lease(tenant), round(_level(redis_url, requests_key))]
            limiter._expire(tenant)  # what the timer calls when it fires
            await asyncio.gather(*limiter._give_backs)
            seen += [limiter.holds_lease(tenant), round(_level(redis_url, requests_key))]
            await limiter.take_request(tenant, LIMITS)
            return [*seen, round(_level(redis_url, requests_key))]
        finally:
            await limiter.close()

    assert asyncio.run(scenario()) == [True, BURST - 2, False, BURST - 1, BURST - 2]


def test_a_lease_is_spent_while_redis_is_down_and_its_give_back_only_logs() -> None:
    """A lease needs no Redis to be spent; a give-back that cannot reach Redis logs and is dropped
    (the bucket then misses that one request until it refills), and close() still returns."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def scenario() -> list[bool]:
        limiter = RateLimiter("redis://127.0.0.1:9/0", timeout_s=0.2, lease_hold_s=60)
        limits = TenantLimits(requests_per_s=0.001, burst_requests=BURST, on_redis_down="closed")
        limiter._hold(tenant, limits)  # as a token charge that leased one before Redis went away
        spent = await limiter.take_request(tenant, limits)
        limiter._hold(tenant, limits)
        await limiter.close()  # its give-back fails against the closed port
        return [spent.is_admitted, spent.is_degraded, limiter.holds_lease(tenant)]

    assert asyncio.run(scenario()) == [True, False, False]
