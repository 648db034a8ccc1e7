"""Settling a stream's token reservation with its completion as soon as the engine has counted it.

Admission took the prompt plus max_tokens from the tenant's bucket (gatekeeper.py); the charge
here is the completion's actual tokens less the `num_reserved` max_tokens, so what the stream did
not use goes back to the bucket (never past its capacity). Every way a call ends after its
reservation settles it exactly once: the done message (`settle`), a cancel, a failure or a
prompt blocked before the engine ran (`stream_ended`, which the servicer also calls when the call
ends, whether or not its answer started), and a refusal after the take (`refused`). A gateway that
dies mid-stream settles nothing: its reservations stay spent until the bucket refills, which errs
on the tenant's side of its budget, never past it.

The engine's last message carries the completion's token count, and the output screen of the
last text comes after it. The charge (one Redis script, a round trip of about 0.5-1 ms) starts
at that message, once the last screen's call has gone out, so it runs beside that screen instead
of after it or ahead of it; the done message still goes out only once the charge is written, so a
caller's next call sees it as before.

What a stream that reaches its done message is charged does not change. A stream cut by an
output block is charged the tokens generated until then: the engine's count when its last message
came, else the gateway's, at the done message. A prompt blocked under the trailing policy is
charged no completion, as before, though the engine may have finished first: the charge starts
only once the prompt passed. A stream that the caller cancels, or that fails, after the engine's
last message came is charged its completion, and one that ends before it is charged the tokens
already released to the caller (`stream_ended`): cancelling a stream after its first windows
does not make them free. A charge once started completes even when the caller goes away.
A call admitted while Redis was down reserved nothing (`num_reserved` 0): its completion is
charged after the fact, as before reservations.
"""

from __future__ import annotations

import asyncio

from services.common import tasks
from services.gateway.loop import let_calls_go_out
from services.gateway.rate_limiter import RateLimiter
from services.gateway.tenants import TenantLimits


class CompletionCharge:
    """One stream's completion charge against its reservation: started by `engine_counted` and
    `prompt_passed` together, awaited by `settle` before the done message. Only the first count is
    charged, and only once; `num_reserved` (the max_tokens taken at admission) is given back less
    what the count used."""

    def __init__(
        self, limiter: RateLimiter, tenant: str, limits: TenantLimits, num_reserved: int = 0
    ) -> None:
        self.limiter = limiter
        self.tenant = tenant
        self.limits = limits
        self.num_reserved = num_reserved
        self.is_prompt_passed = False
        self.num_tokens: int | None = None  # the engine's count, once its last message came
        self._task: asyncio.Task[None] | None = None

    @property
    def is_started(self) -> bool:
        """Whether the charge has gone out (it then completes even if the stream is cut)."""
        return self._task is not None

    def engine_counted(self, num_tokens: int) -> None:
        """The engine's last message came with `num_tokens`; charges them once the prompt passed."""
        if self.num_tokens is None:
            self.num_tokens = num_tokens
            self._start_when_due()

    def prompt_passed(self) -> None:
        """The prompt's screen passed; charges the engine's count when it came already."""
        self.is_prompt_passed = True
        self._start_when_due()

    def stream_ended(self, num_released: int) -> None:
        """The stream ended (cancelled, failed, blocked or done); when no charge has started, charges
        the `num_released` tokens the caller received and gives the rest of the reservation back.
        Tokens released at all mean the prompt passed."""
        if self._task is None and (num_released > 0 or self.num_reserved > 0):
            self._start(num_released)

    def refused(self) -> None:
        """The call was refused after its reservation was taken: gives all of it back."""
        self.stream_ended(0)

    async def settle(self, num_tokens: int) -> None:
        """Waits for the charge; starts it with `num_tokens`, the done message's count, if none started."""
        if self._task is None:
            self._start(num_tokens)
        assert self._task is not None
        await asyncio.shield(self._task)

    def _start_when_due(self) -> None:
        if self._task is None and self.is_prompt_passed and self.num_tokens is not None:
            self._start(self.num_tokens)

    def _start(self, num_tokens: int) -> None:
        self._task = asyncio.ensure_future(self._charge(num_tokens))
        tasks.hold(self._task)  # a charge once started completes even when the stream is gone

    async def _charge(self, num_tokens: int) -> None:
        # The engine's last message starts the output screen's last check in the same loop turn;
        # that call goes out first, and the charge has the whole check to finish in.
        await let_calls_go_out()
        await self.limiter.charge_tokens(self.tenant, self.limits, num_tokens - self.num_reserved)
