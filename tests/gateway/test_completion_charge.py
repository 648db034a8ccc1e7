"""A stream's completion charge against a real redis-server: when it starts, and what it charges."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import redis

from services.gateway.completion_charge import CompletionCharge
from services.gateway.rate_limiter import RateLimiter, bucket_keys
from services.gateway.tenants import TenantLimits

# One token a minute: within a test the bucket refills by well under one token.
LIMITS = TenantLimits(tokens_per_min=1, burst_tokens=100)


def _charged(
    redis_url: str, scenario: Callable[[CompletionCharge], Awaitable[None]], num_reserved: int | None = None
) -> int:
    """Runs `scenario` on a fresh tenant's charge; the tokens its bucket is down by at the end.

    With `num_reserved`, the call first reserved 5 prompt tokens + `num_reserved` max_tokens, as the
    gatekeeper takes them, and its bucket must exist at the end."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        limiter = RateLimiter(redis_url, timeout_s=2.0)
        try:
            if num_reserved is not None:
                assert (await limiter.take_tokens(tenant, LIMITS, 5 + num_reserved)).is_admitted
            await scenario(CompletionCharge(limiter, tenant, LIMITS, num_reserved or 0))
        finally:
            await limiter.close()

    asyncio.run(run())
    level = redis.Redis.from_url(redis_url).hget(bucket_keys(tenant)[1], "level")
    if level is None:  # nothing was ever taken from the bucket
        assert num_reserved is None, f"tenant {tenant} reserved tokens but has no token bucket"
        return 0
    return LIMITS.token_capacity - round(float(level))


def test_the_engine_count_is_charged_once_the_prompt_passed_and_before_settle(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.engine_counted(7)
        assert not charge.is_started  # the prompt's screen has not passed yet
        charge.prompt_passed()
        assert charge.is_started  # beside the output screen, not after it
        await charge.settle(7)

    assert _charged(redis_url, scenario) == 7


def test_a_prompt_passed_first_starts_the_charge_at_the_engine_count(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        assert not charge.is_started
        charge.engine_counted(4)
        charge.engine_counted(9)  # only the first count is charged
        await charge.settle(4)

    assert _charged(redis_url, scenario) == 4


def test_a_blocked_prompt_is_charged_no_completion_though_the_engine_finished(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.engine_counted(12)  # trailing: the engine may finish before the prompt's verdict
        await charge.settle(0)  # the blocked prompt's done message reports no completion

    assert _charged(redis_url, scenario) == 0


def test_a_stream_cut_before_the_engine_count_is_charged_at_settle(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        await charge.settle(3)  # an output block mid-stream: the tokens the gateway saw

    assert _charged(redis_url, scenario) == 3


def test_a_stream_that_ends_before_any_count_is_charged_what_it_released(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        charge.stream_ended(24)  # the caller cancelled after two windows
        assert charge.is_started
        charge.stream_ended(40)  # only once
        await charge.settle(40)

    assert _charged(redis_url, scenario) == 24


def test_a_stream_ended_after_its_charge_started_is_not_charged_again(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        charge.engine_counted(9)
        charge.stream_ended(9)
        await charge.settle(9)

    assert _charged(redis_url, scenario) == 9


def test_a_stream_that_released_nothing_is_charged_nothing_when_it_ends(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.stream_ended(0)  # e.g. cancelled while the prompt was screened
        assert not charge.is_started

    assert _charged(redis_url, scenario) == 0


def test_a_finished_stream_gives_back_the_max_tokens_it_did_not_use(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        charge.engine_counted(7)
        await charge.settle(7)

    assert _charged(redis_url, scenario, num_reserved=60) == 5 + 7


def test_a_cancelled_stream_gives_back_all_but_what_it_released(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.prompt_passed()
        charge.stream_ended(24)
        await charge.settle(24)

    assert _charged(redis_url, scenario, num_reserved=60) == 5 + 24


def test_a_stream_that_released_nothing_gives_its_whole_reservation_back(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.stream_ended(0)  # a prompt blocked before the engine ran, or cancelled in its screen
        assert charge.is_started
        await charge.settle(0)

    assert _charged(redis_url, scenario, num_reserved=60) == 5


def test_a_call_refused_after_its_reservation_keeps_only_its_prompt_spent(redis_url: str) -> None:
    async def scenario(charge: CompletionCharge) -> None:
        charge.refused()
        charge.stream_ended(0)  # the servicer's end finds it settled already
        await charge.settle(0)

    assert _charged(redis_url, scenario, num_reserved=60) == 5


def test_a_give_back_never_lifts_the_bucket_past_its_capacity(redis_url: str) -> None:
    """The bucket refilled while the call ran (moved back in time here): the unused reservation
    is given back only up to the bucket's capacity."""

    async def scenario(charge: CompletionCharge) -> None:
        key = bucket_keys(charge.tenant)[1]
        client = redis.Redis.from_url(redis_url)
        client.hset(key, "at_us", int(client.hget(key, "at_us") or 0) - 3600 * 10**6)  # 60 tokens' worth
        charge.prompt_passed()
        charge.engine_counted(2)
        await charge.settle(2)

    assert _charged(redis_url, scenario, num_reserved=60) == 0
