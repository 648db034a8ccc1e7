"""Token budgets: the prompt counted by the engine's own tokenizer, checked against the limits.

The gateway never loads a tokenizer: it asks an engine replica (`CountTokens`), which counts
exactly what Generate will see (BOS, or the chat rendered by the model's template). The call is
asynchronous, so the gateway's event loop never tokenizes. Counts are cached by (model, prompt
hash): a tokenizer is deterministic per model, and callers repeat themselves (retries, long
shared system prompts, benchmark loops), so a hit saves one engine round trip per request.

A call reserves its prompt plus its max_tokens in the tenant's token bucket (rate_limiter.py):
one that can never fit the bucket is INVALID_ARGUMENT here, like one over `max_request_tokens`;
one that does not fit now is RESOURCE_EXHAUSTED (`refuse_reservation`), saying when it will and
which smaller max_tokens would fit now.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import NewType

from services.common.errors import InvalidArgument, ResourceExhausted
from services.gateway.off_loop import off_loop_when_long
from services.gateway.rate_limiter import RateDecision, refuse, retry_after_s, retry_metadata
from services.gateway.tenants import TenantLimits
from services.gateway.upstream import Upstreams
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb

PromptHash = NewType("PromptHash", bytes)
DEFAULT_CACHE_ENTRIES = 4096
COUNT_TIMEOUT_S = 5.0  # a count is one tokenizer pass; longer means the engine is in trouble


def count_request(request: pb.GenerateRequest) -> engine_pb2.CountTokensRequest:
    """The engine's CountTokens request for a client request's input."""
    if request.WhichOneof("input") == "chat":
        messages = [engine_pb2.ChatMessage(role=m.role, content=m.content) for m in request.chat.messages]
        return engine_pb2.CountTokensRequest(chat=engine_pb2.ChatTurns(messages=messages))
    return engine_pb2.CountTokensRequest(prompt=request.prompt)


def prompt_hash(request: engine_pb2.CountTokensRequest) -> PromptHash:
    """sha256 of the input's canonical bytes (sizes are bounded before this: ~1 ms per MiB)."""
    return PromptHash(hashlib.sha256(request.SerializeToString(deterministic=True)).digest())


class PromptCounter:
    """Counts prompt tokens through the engine's CountTokens, with an LRU cache in front.

    The cache is an OrderedDict moved-to-end on a hit, so eviction drops the least recently
    used count in O(1); entries are a 32-byte hash and an int, so 4096 of them cost well under 1 MiB.
    """

    name = "the engine's tokenizer"

    def __init__(self, upstreams: Upstreams, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self.upstreams = upstreams
        self.max_entries = max_entries
        self._counts: OrderedDict[tuple[str, PromptHash], int] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    async def count(
        self, request: pb.GenerateRequest, model: str, num_chars: int = 0, caller_left_s: float | None = None
    ) -> int:
        """The number of prompt tokens the engine serving `model` will see (`num_chars`: the prompt's
        length, which decides whether its hash is taken on a worker thread). The engine's count
        waits COUNT_TIMEOUT_S, or the caller's `caller_left_s` when that is shorter."""
        counted = count_request(request)
        key = (model, await off_loop_when_long(prompt_hash, counted, num_chars))
        if (cached := self._counts.get(key)) is not None:
            self._counts.move_to_end(key)
            self.num_hits += 1
            return cached
        self.num_misses += 1
        num_tokens = await self.upstreams.count_tokens(counted, COUNT_TIMEOUT_S, caller_left_s)
        self._remember(key, num_tokens)
        return num_tokens

    def _remember(self, key: tuple[str, PromptHash], num_tokens: int) -> None:
        self._counts[key] = num_tokens
        if len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)


def check_request_budget(
    tenant: str, limits: TenantLimits, prompt_tokens: int, max_tokens: int, counted_by: str
) -> None:
    """INVALID_ARGUMENT with both counts when one request asks for more than its tenant allows."""
    asked = prompt_tokens + max_tokens
    if asked > limits.max_request_tokens:
        raise InvalidArgument(
            f"request exceeds its token budget: {prompt_tokens} prompt tokens (counted with {counted_by}) + "
            f"{max_tokens} max_tokens = {asked}, but tenant {tenant!r} allows {limits.max_request_tokens} "
            "per request; shorten the prompt or lower max_tokens"
        )
    if prompt_tokens >= limits.token_capacity:
        raise InvalidArgument(
            f"prompt of {prompt_tokens} tokens leaves no room for a completion in tenant {tenant!r}'s token "
            f"bucket of {limits.token_capacity} tokens ({limits.tokens_per_min} tokens/min); it can never "
            "be admitted: shorten the prompt"
        )
    if asked > limits.token_capacity:
        raise InvalidArgument(
            f"request reserves {prompt_tokens} prompt tokens + {max_tokens} max_tokens = {asked}, more than "
            f"tenant {tenant!r}'s token bucket of {limits.token_capacity} tokens ({limits.tokens_per_min} "
            f"tokens/min) holds; it can never be admitted: set max_tokens to at most "
            f"{limits.token_capacity - prompt_tokens}"
        )


def refuse_reservation(
    tenant: str, limits: TenantLimits, decision: RateDecision, prompt_tokens: int, max_tokens: int
) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED of a call whose prompt plus max_tokens does not fit the tenant's token
    bucket now: when it will, and the largest max_tokens that fits now, when one does."""
    if decision.retry_after_ms < 0:
        return refuse(tenant, limits, decision)
    num_left = max(0, math.floor(decision.num_tokens_left))
    seconds = retry_after_s(decision)
    max_fitting = num_left - prompt_tokens
    advice = f"set max_tokens to at most {max_fitting} to run now, or " if max_fitting >= 1 else ""
    return ResourceExhausted(
        f"token budget of tenant {tenant!r} reached: this request reserves {prompt_tokens} prompt tokens + "
        f"{max_tokens} max_tokens = {prompt_tokens + max_tokens}, and the bucket holds {num_left} now "
        f"({limits.tokens_per_min} tokens/min in bursts of {limits.token_capacity}; requests in flight "
        f"give back what they do not use when they end); {advice}retry after {seconds:g} s",
        trailing_metadata=retry_metadata(decision.retry_after_ms),
    )
