"""Per-tenant rate limits shared by every gateway replica: two token buckets in Redis.

One Lua script takes from both buckets of a tenant (requests, refilled at `requests_per_s` up to
`burst_requests`; tokens, refilled at `tokens_per_min / 60` up to `burst_tokens`), refills them
from Redis's own clock, and charges both or neither. Because Redis runs a script atomically, any
number of gateways share the buckets without races. A call is charged in two steps: one request
right after authentication (`take_request`), before any other work, so that every later refusal
has cost the caller; then, once the prompt is counted, its prompt tokens plus its max_tokens, the
most the call can spend (`take_tokens`): concurrent calls can never spend more than the bucket
holds. When the stream ends, the completion's actual tokens settle that reservation
(`charge_tokens` with the difference, driven by completion_charge.py): what the call did not use
goes back, never past the bucket's capacity. A call admitted while Redis was down (fails open)
reserved nothing and is charged its completion after the fact, which may push the bucket below
zero; the tenant then waits until it refills.

When Redis cannot be reached within the timeout, the tenant's `on_redis_down` rule decides:
"open" lets the call through (and says so in the audit log), "closed" refuses it UNAVAILABLE.

**Request leases.** The request bucket's round trip is the one Redis call in front of every
other piece of a call's work. To take it off the path, the call's token reservation (which runs while
the screen is in flight) also takes one request ahead of the tenant's next call, when a whole
request is left in the bucket after it, and this gateway holds it (`_Lease`). The tenant's next
call here spends it with no Redis call. A lease is taken from the shared bucket before it is
spent, so over time the replicas together admit no more than the bucket's rate; a replica holds
(and asks for) at most one per tenant, and gives it back to the bucket when it is not spent within
`lease_hold_s` (`THERMOCLINE_GATEWAY_RATE_LEASE_HOLD_S`; 0 turns leases off). The price: a call may
be admitted up to `lease_hold_s` after its request was taken from the bucket, so in a short window
a tenant can get its burst plus one request per replica (the bucket refills to its burst while a
lease is out); while a replica holds a lease, another replica can find that one request missing;
and a tenant in token debt is refused at its token charge rather than at its request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from typing import NamedTuple

import redis.asyncio as redis
from redis.exceptions import RedisError

from services.common.errors import ResourceExhausted, Unavailable
from services.gateway.tenants import FAIL_OPEN, TenantLimits

log = logging.getLogger(__name__)

# KEYS: requests bucket, tokens bucket. ARGV: request rate/s, request burst, token rate/s,
# token capacity, requests to charge, tokens to charge, requests to lease (0 or 1: taken as well
# when the call is admitted and a whole request is left in the bucket after the lease).
# Each bucket is a hash {level, at_us}. Returns {admitted (1/0), retry_after_ms, request level
# after, token level after, requests leased}.
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
local admitted, leased = 0, 0
if wait_ms == 0 then
  requests = requests - req_cost
  tokens = tokens - cost
  admitted = 1
  local lease = tonumber(ARGV[7] or '0')
  if lease > 0 and requests >= lease + 1 then
    requests = requests - lease
    leased = lease
  end
end
local ttl = 3600
redis.call('HSET', KEYS[1], 'level', tostring(requests), 'at_us', now_us)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('HSET', KEYS[2], 'level', tostring(tokens), 'at_us', now_us)
redis.call('EXPIRE', KEYS[2], ttl)
return {admitted, wait_ms, tostring(requests), tostring(tokens), leased}
"""

# KEYS: one bucket. ARGV: its rate/s, its capacity, the amount to charge (negative: given back,
# never past the capacity).
CHARGE_SCRIPT = """
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local state = redis.call('HMGET', KEYS[1], 'level', 'at_us')
local rate, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local value, at = tonumber(state[1]), tonumber(state[2])
if value == nil then value = capacity
else value = math.min(capacity, value + math.max(0, now_us - at) * rate / 1000000) end
value = math.min(capacity, value - tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'level', tostring(value), 'at_us', now_us)
redis.call('EXPIRE', KEYS[1], 3600)
return tostring(value)
"""

RETRY_AFTER_KEY = "retry-after-ms"
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class RateDecision(NamedTuple):
    """The limiter's answer: admitted, or how long to wait; `is_degraded` when Redis was down.
    `num_tokens_left`: the token bucket's level after the take (for a refusal, what it holds now)."""

    is_admitted: bool
    retry_after_ms: int = 0
    is_degraded: bool = False
    num_tokens_left: float = 0.0


def bucket_keys(tenant: str) -> tuple[str, str]:
    """The Redis keys of a tenant's request and token buckets (one hash slot in a cluster)."""
    return f"thermocline:rl:{{{tenant}}}:requests", f"thermocline:rl:{{{tenant}}}:tokens"


def retry_metadata(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that tells a client (and gRPC retry policies) when to come back."""
    return ((RETRY_AFTER_KEY, str(retry_after_ms)), (PUSHBACK_KEY, str(retry_after_ms)))


class _Lease(NamedTuple):
    """One request a replica took ahead of its tenant's next call, and the timer that gives it back."""

    limits: TenantLimits
    expiry: asyncio.TimerHandle


class RateLimiter:
    """Takes from and charges the tenants' buckets in Redis; holds their request leases."""

    def __init__(self, url: str, timeout_s: float, lease_hold_s: float = 0.0) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._take = self._client.register_script(TAKE_SCRIPT)
        self._charge = self._client.register_script(CHARGE_SCRIPT)
        self._lease_hold_s = lease_hold_s
        self._leases: dict[str, _Lease] = {}
        self._leasing: set[str] = set()  # tenants whose token charge is asking for a lease now
        self._give_backs: set[asyncio.Task[None]] = set()

    def holds_lease(self, tenant: str) -> bool:
        """Whether this replica holds a request of `tenant`'s bucket for its next call."""
        return tenant in self._leases

    async def take_request(self, tenant: str, limits: TenantLimits) -> RateDecision:
        """One request for the tenant: its lease when this replica holds one (no Redis call), else
        one from its bucket, refused too while its token bucket is in debt."""
        lease = self._leases.pop(tenant, None)
        if lease is not None:
            lease.expiry.cancel()
            return RateDecision(is_admitted=True)
        return await self.take(tenant, limits, num_requests=1, num_tokens=0)

    async def take_tokens(self, tenant: str, limits: TenantLimits, num_tokens: int) -> RateDecision:
        """`num_tokens` from the tenant's token bucket, or a refusal; when admitted, also leases
        one request for the tenant's next call (see the module's docstring)."""
        if self._lease_hold_s == 0 or tenant in self._leases or tenant in self._leasing:
            return await self.take(tenant, limits, num_requests=0, num_tokens=num_tokens)
        self._leasing.add(tenant)  # one lease asked for at a time: concurrent calls ask for none
        try:
            return await self.take(tenant, limits, num_requests=0, num_tokens=num_tokens, num_lease=1)
        finally:
            self._leasing.discard(tenant)

    async def take(
        self, tenant: str, limits: TenantLimits, num_requests: int, num_tokens: int, num_lease: int = 0
    ) -> RateDecision:
        """`num_requests` and `num_tokens` from the tenant's buckets, both or neither, or a refusal;
        `num_lease` (0 or 1) more requests to hold for the tenant's next call, when there are spare."""
        args = [limits.requests_per_s, limits.burst_requests, limits.tokens_per_s]
        args += [limits.token_capacity, num_requests, num_tokens, num_lease]
        try:
            admitted, wait_ms, _, tokens_left, leased = await self._take(
                keys=list(bucket_keys(tenant)), args=args
            )
        except (RedisError, OSError) as error:
            return self._redis_down(tenant, limits, error)
        if int(leased) > 0:
            self._hold(tenant, limits)
        return RateDecision(bool(admitted), int(wait_ms), num_tokens_left=float(tokens_left))

    def _hold(self, tenant: str, limits: TenantLimits) -> None:
        """Keeps a leased request for `lease_hold_s` (`take_tokens` asks for one only when none
        is held or asked for)."""
        expiry = asyncio.get_running_loop().call_later(self._lease_hold_s, self._expire, tenant)
        self._leases[tenant] = _Lease(limits, expiry)

    def _expire(self, tenant: str) -> None:
        lease = self._leases.pop(tenant, None)
        if lease is not None:
            self._give_back_soon(tenant, lease.limits)

    def _give_back_soon(self, tenant: str, limits: TenantLimits) -> None:
        """Returns a request to the bucket in the background, outside any call's trace."""
        task = asyncio.get_running_loop().create_task(
            self._give_back(tenant, limits), context=contextvars.Context()
        )
        self._give_backs.add(task)
        task.add_done_callback(self._give_backs.discard)

    async def _give_back(self, tenant: str, limits: TenantLimits) -> None:
        try:
            await self._charge(
                keys=[bucket_keys(tenant)[0]], args=[limits.requests_per_s, limits.burst_requests, -1]
            )
        except (RedisError, OSError) as error:
            log.warning("could not give a leased request back to %s's bucket: %s", tenant, error)

    def _redis_down(self, tenant: str, limits: TenantLimits, error: Exception) -> RateDecision:
        log.warning("rate limiter unreachable (%s); tenant %s fails %s", error, tenant, limits.on_redis_down)
        if limits.on_redis_down == FAIL_OPEN:
            return RateDecision(is_admitted=True, is_degraded=True)
        raise Unavailable(
            "the rate limiter is unreachable and this tenant's policy fails closed; retry shortly",
            trailing_metadata=retry_metadata(1000),
        )

    async def charge_tokens(self, tenant: str, limits: TenantLimits, num_tokens: int) -> None:
        """Charges tokens after the fact; a negative count gives them back (a reservation's unused
        part), never past the bucket's capacity. A Redis failure only logs: a reservation not given
        back stays spent, which errs on the tenant's side of its budget."""
        if num_tokens == 0:
            return
        try:
            await self._charge(
                keys=[bucket_keys(tenant)[1]], args=[limits.tokens_per_s, limits.token_capacity, num_tokens]
            )
        except (RedisError, OSError) as error:
            log.warning(
                "could not charge %d tokens to %s (negative: a give-back): %s", num_tokens, tenant, error
            )

    async def close(self) -> None:
        """Gives every held lease back to its bucket, then closes the connection pool."""
        leases, self._leases = self._leases, {}
        for tenant, lease in leases.items():
            lease.expiry.cancel()
            self._give_back_soon(tenant, lease.limits)
        if self._give_backs:  # together: with Redis down, one timeout in all, not one per tenant
            await asyncio.gather(*self._give_backs, return_exceptions=True)
        await self._client.aclose()


def refuse(tenant: str, limits: TenantLimits, decision: RateDecision) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED a refused tenant gets, with retry-after metadata."""
    if decision.retry_after_ms < 0:
        return ResourceExhausted(
            f"tenant {tenant!r} has a rate of zero for this request; ask an administrator to raise it"
        )
    return ResourceExhausted(
        f"rate limit for tenant {tenant!r} reached ({limits.requests_per_s:g} requests/s in bursts of "
        f"{limits.burst_requests}, {limits.tokens_per_min} tokens/min in bursts of {limits.token_capacity}); "
        f"retry after {retry_after_s(decision):g} s",
        trailing_metadata=retry_metadata(decision.retry_after_ms),
    )


def retry_after_s(decision: RateDecision) -> float:
    """A refusal's wait in seconds, rounded up to a tenth, as its messages state it."""
    return math.ceil(decision.retry_after_ms / 100) / 10
