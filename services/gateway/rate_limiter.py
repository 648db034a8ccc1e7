"""Per-tenant rate limits shared by every gateway replica: two token buckets in Redis.

One Lua script takes from both buckets of a tenant (requests, refilled at `requests_per_s` up to
`burst_requests`; tokens, refilled at `tokens_per_min / 60` up to `burst_tokens`), refills them
from Redis's own clock, and charges both or neither. Because Redis runs a script atomically, any
number of gateways share the buckets without races. A call is charged in two steps: one request
right after authentication (`take_request`), before any other work, so that every later refusal
has cost the caller; then its prompt tokens once they are counted (`take_tokens`). The
completion's tokens are charged when the engine reports them, before the stream's done message
(`charge_tokens`, driven by completion_charge.py), and may push the token bucket below zero; the
tenant then waits until it refills.

When Redis cannot be reached within the timeout, the tenant's `on_redis_down` rule decides:
"open" lets the call through (and says so in the audit log), "closed" refuses it UNAVAILABLE.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import redis.asyncio as redis
from redis.exceptions import RedisError

from services.common.errors import ResourceExhausted, Unavailable
from services.gateway.tenants import FAIL_OPEN, TenantLimits

log = logging.getLogger(__name__)

# KEYS: requests bucket, tokens bucket. ARGV: request rate/s, request burst, token rate/s,
# token capacity, requests to charge, tokens to charge. Each bucket is a hash {level, at_us}.
# Returns {admitted (1/0), retry_after_ms, request level after, token level after}.
TAKE_SCRIPT = """
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local function level(key, rate, capacity)
  local state = redis.call('HMGET', key, 'level', 'at_us')
  local value, at = tonumber(state[1]), tonumber(state[2])
  if value == nil then return capacity end
  return math.min(capacity, value + math.max(0, now_us - at) * rate / 1000000)
end
local req_rate, req_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_rate, tok_cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local req_cost, cost = tonumber(ARGV[5]), tonumber(ARGV[6])
local requests = level(KEYS[1], req_rate, req_cap)
local tokens = level(KEYS[2], tok_rate, tok_cap)
local wait_ms = 0
if requests < req_cost then
  wait_ms = req_rate > 0 and math.ceil((req_cost - requests) * 1000 / req_rate) or -1
end
if tokens < cost then
  local tok_wait = tok_rate > 0 and math.ceil((cost - tokens) * 1000 / tok_rate) or -1
  if tok_wait < 0 or wait_ms < 0 then wait_ms = -1 else wait_ms = math.max(wait_ms, tok_wait) end
end
local admitted = 0
if wait_ms == 0 then
  requests = requests - req_cost
  tokens = tokens - cost
  admitted = 1
end
local ttl = 3600
redis.call('HSET', KEYS[1], 'level', tostring(requests), 'at_us', now_us)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HSET', KEYS[2], 'level', tostring(tokens), 'at_us', now_us)
redis.call('EXPIRE', KEYS[2], ttl)
return {admitted, wait_ms, tostring(requests), tostring(tokens)}
"""

# KEYS: tokens bucket. ARGV: token rate/s, token capacity, tokens to charge.
CHARGE_SCRIPT = """
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local state = redis.call('HMGET', KEYS[1], 'level', 'at_us')
local rate, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local value, at = tonumber(state[1]), tonumber(state[2])
if value == nil then value = capacity
else value = math.min(capacity, value + math.max(0, now_us - at) * rate / 1000000) end
value = value - tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'level', tostring(value), 'at_us', now_us)
redis.call('EXPIRE', KEYS[1], 3600)
return tostring(value)
"""

RETRY_AFTER_KEY = "retry-after-ms"
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class RateDecision(NamedTuple):
    """The limiter's answer: admitted, or how long to wait; `is_degraded` when Redis was down."""

    is_admitted: bool
    retry_after_ms: int = 0
    is_degraded: bool = False


def bucket_keys(tenant: str) -> tuple[str, str]:
    """The Redis keys of a tenant's request and token buckets (one hash slot in a cluster)."""
    return f"thermocline:rl:{{{tenant}}}:requests", f"thermocline:rl:{{{tenant}}}:tokens"


def retry_metadata(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that tells a client (and gRPC retry policies) when to come back."""
    return ((RETRY_AFTER_KEY, str(retry_after_ms)), (PUSHBACK_KEY, str(retry_after_ms)))


class RateLimiter:
    """Takes from and charges the tenants' buckets in Redis."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._take = self._client.register_script(TAKE_SCRIPT)
        self._charge = self._client.register_script(CHARGE_SCRIPT)

    async def take_request(self, tenant: str, limits: TenantLimits) -> RateDecision:
        """One request from the tenant's bucket; refused too while its token bucket is in debt."""
        return await self.take(tenant, limits, num_requests=1, num_tokens=0)

    async def take_tokens(self, tenant: str, limits: TenantLimits, num_tokens: int) -> RateDecision:
        """`num_tokens` from the tenant's token bucket, or a refusal."""
        return await self.take(tenant, limits, num_requests=0, num_tokens=num_tokens)

    async def take(
        self, tenant: str, limits: TenantLimits, num_requests: int, num_tokens: int
    ) -> RateDecision:
        """`num_requests` and `num_tokens` from the tenant's buckets, both or neither, or a refusal."""
        args = [limits.requests_per_s, limits.burst_requests, limits.tokens_per_s]
        args += [limits.token_capacity, num_requests, num_tokens]
        try:
            admitted, wait_ms, *_ = await self._take(keys=list(bucket_keys(tenant)), args=args)
        except (RedisError, OSError) as error:
            return self._redis_down(tenant, limits, error)
        return RateDecision(is_admitted=bool(admitted), retry_after_ms=int(wait_ms))

    def _redis_down(self, tenant: str, limits: TenantLimits, error: Exception) -> RateDecision:
        log.warning("rate limiter unreachable (%s); tenant %s fails %s", error, tenant, limits.on_redis_down)
        if limits.on_redis_down == FAIL_OPEN:
            return RateDecision(is_admitted=True, is_degraded=True)
        raise Unavailable(
            "the rate limiter is unreachable and this tenant's policy fails closed; retry shortly",
            trailing_metadata=retry_metadata(1000),
        )

    async def charge_tokens(self, tenant: str, limits: TenantLimits, num_tokens: int) -> None:
        """Charges generated tokens after the fact; a Redis failure only logs."""
        if num_tokens <= 0:
            return
        try:
            await self._charge(
                keys=[bucket_keys(tenant)[1]], args=[limits.tokens_per_s, limits.token_capacity, num_tokens]
            )
        except (RedisError, OSError) as error:
            log.warning("could not charge %d tokens to %s: %s", num_tokens, tenant, error)

    async def close(self) -> None:
        """Closes the connection pool."""
        await self._client.aclose()


def refuse(tenant: str, limits: TenantLimits, decision: RateDecision) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED a refused tenant gets, with retry-after metadata."""
    if decision.retry_after_ms < 0:
        return ResourceExhausted(
            f"tenant {tenant!r} has a rate of zero for this request; ask an administrator to raise it"
        )
    seconds = math.ceil(decision.retry_after_ms / 100) / 10
    return ResourceExhausted(
        f"rate limit for tenant {tenant!r} reached ({limits.requests_per_s:g} requests/s in bursts of "
        f"{limits.burst_requests}, {limits.tokens_per_min} tokens/min in bursts of {limits.token_capacity}); "
        f"retry after {seconds:g} s",
        trailing_metadata=retry_metadata(decision.retry_after_ms),
    )
