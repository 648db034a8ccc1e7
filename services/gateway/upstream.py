"""Calls from the gateway to safety and the engine, with their failures made actionable, and the
gateway's readiness, which depends on both.

The safety service's health checks stay open, like the engine's, so only a call that carries the
mesh's service token shows whether it takes ours. The screens are such calls, but a gateway with
no traffic makes none, and would look ready while every first request fails. So the gateway also
asks the safety service for its gate's metadata (GetGate, metadata_only: no weights) on the
engine stats poll's interval (THERMOCLINE_GATEWAY_ENGINE_STATS_INTERVAL_S): UNAUTHENTICATED marks
the token refused (metrics.TokenHealth: one ERROR a minute, the gauge), an answer clears it, and
any other failure (safety down, slow) leaves it as it was. A safety service that is down says
nothing about the token, and it is not a readiness problem of its own: every gateway shares it, so
taking them all out of rotation would help no one, while its callers hear UNAVAILABLE "retry
later", which is true. `Upstreams.readiness_problem` is the one place the gateway's readiness is
composed: /ready answers it and the gRPC readiness (services/gateway/__main__.py) follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from typing import NamedTuple

import grpc

from services.common import telemetry
from services.common.channels import open_channel
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ThermoclineError,
    Unavailable,
)
from services.common.service_auth import TOKEN_FILE_SETTING
from services.gateway.metrics import TokenHealth
from services.gateway.router import Router
from services.gateway.tenants import GateCategory, SafetyOverrides
from thermocline.engine.v1 import engine_pb2
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

log = logging.getLogger(__name__)

# Statuses an upstream returns about the request itself: the caller sees them as they are.
_PASSED_THROUGH: dict[grpc.StatusCode, type[ThermoclineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    # e.g. the tenant's safety policy names a category the gate no longer has: the operator's to fix
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}


SAFETY_TOKEN_REFUSED = (
    "the safety service refuses this gateway's service token: a configuration fault that the operator "
    f"must fix, which waiting will not mend; check that {TOKEN_FILE_SETTING} names the same token on "
    "this gateway and on its safety service (the gateway's log names the safety service's address)"
)


def tenant_policy_pb(overrides: SafetyOverrides) -> safety_pb2.TenantPolicy:
    """What the safety service applies for a tenant: its categories off and loosened thresholds."""
    return safety_pb2.TenantPolicy(
        categories_off=sorted(overrides.categories_off), thresholds=dict(overrides.thresholds)
    )


class GateInfo(NamedTuple):
    """The gate the safety service screens with: its version and categories."""

    version: str
    categories: dict[str, GateCategory]


def upstream_error(service: str, error: grpc.aio.AioRpcError) -> ThermoclineError:
    """The error the client should see when `service` failed with `error`. UNAUTHENTICATED is the
    gateway's own service token refused: no retry mends it, and its details (the setting to send)
    are the operator's, who reads them in the gateway's log (metrics.TokenHealth)."""
    passed = _PASSED_THROUGH.get(error.code())
    if passed is not None:
        return passed(f"{service}: {error.details()}")
    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
        return Unavailable(
            f"the gateway cannot reach a usable {service}: the {service} refuses the gateway's calls, "
            "a configuration fault that the operator must fix (the gateway logs it); retrying will not "
            "help until then"
        )
    return Unavailable(f"{service} is unavailable ({error.code().name}: {error.details()}); retry later")


def _count_error(error: grpc.aio.AioRpcError, timeout_s: float, waited_s: float) -> ThermoclineError:
    """A count that ran out of the gateway's own bound is UNAVAILABLE (an overloaded engine; clients
    retry it), not the caller's DEADLINE_EXCEEDED: the caller's deadline was further off. One cut
    by the caller's shorter deadline stays DEADLINE_EXCEEDED."""
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and waited_s >= timeout_s:
        return Unavailable(f"the engine did not count the prompt within {timeout_s:g} s; retry later")
    return upstream_error("engine", error)


# The safety channel's gRPC service config: calls in turn over the target's addresses (round_robin),
# and a check that a safety process could not take (UNAVAILABLE: it is stopping, or its connection
# just broke) sent again, to the next address where there are several. Checks only read, so a second
# attempt is safe; gRPC retries only requests of up to 256 KiB (its per-call retry buffer), and never
# past the call's deadline.
SAFETY_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": safety_pb2.DESCRIPTOR.services_by_name["SafetyService"].full_name}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.02s",
                    "maxBackoff": "0.2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


class Upstreams:
    """The engine replicas (through the router) and the safety service."""

    def __init__(self, router: Router, safety_target: str, safety_timeout_s: float | None = None) -> None:
        self.router = router
        # The gateway's own bound on a safety check (THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S): a check
        # that runs out of it is the safety service failing (UNAVAILABLE), not the caller's deadline.
        self.safety_timeout_s = safety_timeout_s
        # A target of several addresses ("ipv4:10.0.0.5:50053,10.0.0.6:50053", or a DNS name with
        # several records, as compose's replicas have) spreads the checks over them, one call each in
        # turn, skipping any that is down: one safety process screens a few hundred checks a second.
        self._safety_channel = open_channel(
            safety_target, trace_calls=False, extra_options=[("grpc.service_config", SAFETY_SERVICE_CONFIG)]
        )  # the stub traces its calls
        self.safety = telemetry.traced_stub(
            safety_pb2_grpc.SafetyServiceStub(self._safety_channel),
            safety_pb2.DESCRIPTOR.services_by_name["SafetyService"],
        )
        self.safety_token = TokenHealth("safety", safety_target)
        self._model_info: engine_pb2.GetModelInfoResponse | None = None
        self._safety_poll: asyncio.Task[None] | None = None
        self._poll_interval_s = router.config.stats_interval_s  # the engine stats poll's, for safety too

    async def start(self) -> None:
        """Starts following the engine replicas and polling the safety service; the first poll ends
        (within the interval) before this returns, so the gateway's first readiness knows of a refusal."""
        await self.router.start()
        await self._poll_safety_once()
        self._safety_poll = asyncio.create_task(self._poll_safety_forever())

    async def _poll_safety_forever(self) -> None:
        """Polls the safety service every interval, until cancelled."""
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self._poll_safety_once()

    async def _poll_safety_once(self) -> None:
        """One poll, bounded by the interval; an unexpected error is logged, and the next poll tries
        again: a gateway never stops (or stops polling) for it."""
        try:
            await self.poll_safety_token(self._poll_interval_s)
        except Exception:
            log.exception("the safety service's token poll failed; the next one tries again")

    async def poll_safety_token(self, timeout_s: float) -> None:
        """Asks the safety service for its gate's metadata, a cheap call that carries our service
        token, and records whether it took it; a call that failed otherwise records nothing."""
        request = safety_pb2.GetGateRequest(metadata_only=True)
        try:
            await self.safety.GetGate(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                self.safety_token.record_refusal()
            return
        self.safety_token.record_accepted()

    def readiness_problem(self) -> str | None:
        """Why the gateway should get no traffic now, or None: the router's reason (no engine
        replica serving, or none taking our token) and the safety service refusing our token, each
        that holds. /ready answers it and the gRPC readiness follows it; it names no address, as
        /ready answers anyone."""
        safety = SAFETY_TOKEN_REFUSED if self.safety_token.is_refused else None
        problems = [p for p in (self.router.readiness_problem(), safety) if p is not None]
        return "; and ".join(problems) or None

    async def model_info(self, timeout_s: float | None) -> engine_pb2.GetModelInfoResponse:
        """The engine's model description, fetched once."""
        if self._model_info is None:
            try:
                self._model_info = await self.router.any_routable().stub.GetModelInfo(
                    engine_pb2.GetModelInfoRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as error:
                raise upstream_error("engine", error) from None
        return self._model_info

    async def count_tokens(
        self, request: engine_pb2.CountTokensRequest, timeout_s: float, caller_left_s: float | None = None
    ) -> int:
        """Prompt tokens as an engine replica counts them: ready replicas first, then live ones,
        then the rest, and the next one when a replica answers UNAVAILABLE (draining before its
        health watch says so). A count waits `timeout_s`, the gateway's own bound, or the caller's
        `caller_left_s` when that is shorter."""
        last_error: grpc.aio.AioRpcError | None = None
        waits_s = timeout_s if caller_left_s is None else min(timeout_s, caller_left_s)
        for replica in self.router.by_preference():
            try:
                reply = await replica.stub.CountTokens(request, timeout=waits_s)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _count_error(error, timeout_s, waits_s) from None
                last_error = error
                continue
            return int(reply.num_tokens)
        assert last_error is not None  # the router always holds at least one replica
        raise upstream_error("engine", last_error)

    async def check_prompt(
        self,
        text: str,
        tenant: str,
        policy: safety_pb2.TenantPolicy,
        timeout_s: float,
        turns: Sequence[str] = (),
        roles: Sequence[str] = (),
    ) -> safety_pb2.CheckResponse:
        """The safety service's verdict on a prompt (a chat: the conversation, its turns and their
        roles), under the tenant's policy."""
        request = safety_pb2.CheckPromptRequest(
            text=text, tenant=tenant, policy=policy, turns=turns, roles=roles
        )
        try:
            reply = await self.safety.CheckPrompt(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise self._safety_error(error, timeout_s) from None
        self.safety_token.record_accepted()
        return reply

    async def check_output(
        self, text: str, prompt: str, tenant: str, policy: safety_pb2.TenantPolicy, timeout_s: float
    ) -> safety_pb2.CheckResponse:
        """The safety service's verdict on generated text, under the tenant's policy."""
        request = safety_pb2.CheckOutputRequest(text=text, prompt=prompt, tenant=tenant, policy=policy)
        try:
            reply = await self.safety.CheckOutput(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise self._safety_error(error, timeout_s) from None
        self.safety_token.record_accepted()
        return reply

    def _safety_error(self, error: grpc.aio.AioRpcError, timeout_s: float) -> ThermoclineError:
        """A check that ran out of the gateway's own safety timeout is UNAVAILABLE (a hung or
        overloaded safety service; clients retry it); one cut by the caller's shorter deadline
        stays DEADLINE_EXCEEDED."""
        own = self.safety_timeout_s
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and own is not None and timeout_s >= own:
            return Unavailable(
                f"safety did not answer within {own:g} s (THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S); retry later"
            )
        return self._safety_failed(error)

    def _safety_failed(self, error: grpc.aio.AioRpcError) -> ThermoclineError:
        """The client's error for a failed safety call; a refused service token is the operator's
        to hear of too."""
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            self.safety_token.record_refusal()
        return upstream_error("safety", error)

    async def gate_info(self, timeout_s: float) -> GateInfo:
        """The safety service's gate version and categories, waiting up to `timeout_s` for it to
        come up (the gateway may start first)."""
        request = safety_pb2.GetGateRequest(metadata_only=True)
        try:
            reply = await self.safety.GetGate(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            raise self._safety_failed(error) from None
        self.safety_token.record_accepted()
        categories = {
            c.name: GateCategory(c.prompt_threshold, c.output_threshold or None) for c in reply.categories
        }
        return GateInfo(reply.version, categories)

    async def close(self) -> None:
        """Stops the safety poll, closes the channels and stops following the replicas."""
        if self._safety_poll is not None:
            self._safety_poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._safety_poll
        await self.router.close()
        await self._safety_channel.close(grace=None)
