"""Relaying the engine's token stream to the client, with output held back until screened.

Text is released in windows: every `check_tokens` tokens, and at the end, the text so far is
sent to the safety service; only text that passed is forwarded. A blocked output ends the
stream with the safe message and FINISH_REASON_SAFETY, and the engine request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from services.common.errors import Unavailable
from services.gateway.router import Replica
from services.gateway.upstream import Upstreams, upstream_error
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.safety.v1 import safety_pb2

# How long a request waits for a replica that is not (yet) serving before trying it anyway.
RECONNECT_WAIT_S = 2.0
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end-of-stream sentinel of call.read()

_FINISH_FROM_ENGINE = {
    engine_pb2.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
    engine_pb2.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH,
    engine_pb2.FINISH_REASON_SAFETY: pb.FINISH_REASON_SAFETY,
    engine_pb2.FINISH_REASON_CANCELLED: pb.FINISH_REASON_CANCELLED,
    engine_pb2.FINISH_REASON_ERROR: pb.FINISH_REASON_ERROR,
}


@dataclass
class HeldOutput:
    """Generated text not yet screened, and everything generated so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    full_text: str = ""
    num_tokens: int = 0  # generated so far, released or not

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        """Holds back one engine message."""
        self.text += message.text
        self.full_text += message.text
        self.token_ids.extend(message.token_ids)
        self.num_tokens += len(message.token_ids)

    def release(self) -> pb.GenerateResponse | None:
        """The held text as one delta, emptying the hold; None when nothing is held."""
        if not self.text and not self.token_ids:
            return None
        delta = pb.GenerateResponse(delta=pb.TextDelta(text=self.text, token_ids=self.token_ids))
        self.text, self.token_ids = "", []
        return delta


@dataclass(frozen=True)
class RelaySettings:
    """What one relay needs besides the engine request."""

    prompt_text: str
    tenant: str
    model: str
    trace_id: str
    check_tokens: int
    safety_timeout_s: float
    deadline_s: float | None
    prompt_tokens: int = 0  # as the gateway counted them: the usage of a stream cut by a block
    # The tenant's categories off and loosened thresholds, sent with every output check.
    safety_policy: safety_pb2.TenantPolicy = field(default_factory=safety_pb2.TenantPolicy)


# Writes the audit event of a verdict that blocked, or passed only under the tenant's policy;
# called before the client sees the outcome. Arguments: the layer ("prompt", "output") and verdict.
VerdictAudit = Callable[[str, safety_pb2.CheckResponse], Awaitable[None]]


async def _no_audit(layer: str, verdict: safety_pb2.CheckResponse) -> None:
    return None


def needs_audit(verdict: safety_pb2.CheckResponse) -> bool:
    """Whether a verdict gets its own audit event: it blocked, or the tenant's policy waived a category."""
    return verdict.decision == safety_pb2.DECISION_BLOCK or bool(verdict.waived)


def final_message(
    reason: int, settings: RelaySettings, usage: engine_pb2.Usage | None = None
) -> pb.GenerateResponse:
    """The closing message of a stream."""
    message = pb.GenerateResponse(
        done=pb.Completion(finish_reason=reason, trace_id=settings.trace_id, model=settings.model)
    )
    if usage is not None:
        message.done.usage.prompt_tokens = usage.prompt_tokens
        message.done.usage.completion_tokens = usage.completion_tokens
        message.done.usage.cached_prompt_tokens = usage.cached_prompt_tokens
        message.done.usage.tiers.hot_tokens = usage.tiers.hot_tokens
        message.done.usage.tiers.warm_tokens = usage.tiers.warm_tokens
        message.done.usage.tiers.cold_tokens = usage.tiers.cold_tokens
    return message


def blocked_messages(
    safe_message: str, settings: RelaySettings, usage: engine_pb2.Usage | None
) -> list[pb.GenerateResponse]:
    """The safe message and a SAFETY finish, which replace a blocked prompt or output."""
    return [
        pb.GenerateResponse(delta=pb.TextDelta(text=safe_message)),
        final_message(pb.FINISH_REASON_SAFETY, settings, usage),
    ]


class _Unstarted(Exception):
    """The replica refused the call (UNAVAILABLE) before sending anything: another may take it."""


def _remaining_s(deadline_at: float | None) -> float | None:
    """Seconds left before the caller's deadline, passed on to the engine."""
    return None if deadline_at is None else max(0.001, deadline_at - time.monotonic())


async def relay(
    upstreams: Upstreams,
    request: engine_pb2.GenerateRequest,
    settings: RelaySettings,
    replicas: list[Replica],
    audit: VerdictAudit = _no_audit,
) -> AsyncIterator[pb.GenerateResponse]:
    """Streams the engine's answer to `request`, screened in windows.

    Replicas are tried in order; a replica that answers UNAVAILABLE before its first message
    (draining, or gone) passes the request to the next one. Once a token has arrived the request
    is never retried, so a client never sees a token twice.
    """
    deadline_at = None if settings.deadline_s is None else time.monotonic() + settings.deadline_s
    last_error: grpc.aio.AioRpcError | None = None
    for replica in replicas:
        if not replica.is_serving:  # e.g. restarting: its Watch says SERVING once it is back
            await replica.wait_serving(min(_remaining_s(deadline_at) or RECONNECT_WAIT_S, RECONNECT_WAIT_S))
        call = replica.stub.Generate(request, timeout=_remaining_s(deadline_at))
        try:
            first = await _first_message(call)
        except _Unstarted as unstarted:
            last_error = unstarted.args[0]
            trace.get_current_span().add_event("engine.retry", {"thermocline.engine.replica": replica.target})
            continue
        trace.get_current_span().set_attribute("thermocline.engine.replica", replica.target)
        async for message in _screened(upstreams, call, first, settings, audit):
            yield message
        return
    assert last_error is not None
    raise upstream_error("engine", last_error)


async def _first_message(call: grpc.aio.UnaryStreamCall) -> Any:
    """The first message of the engine stream (or EOF); _Unstarted when retrying is safe."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            raise _Unstarted(error) from None
        raise upstream_error("engine", error) from None


async def _screened(
    upstreams: Upstreams,
    call: grpc.aio.UnaryStreamCall,
    first: Any,
    settings: RelaySettings,
    audit: VerdictAudit,
) -> AsyncIterator[pb.GenerateResponse]:
    """The stream after its first message, released in screened windows."""
    held = HeldOutput()
    has_audited_waiver = False  # each window re-screens the whole text: one waiver event per stream
    final: engine_pb2.GenerateResponse | None = None
    message = first
    try:
        # Read the stream to its end (the engine closes it after the final message), so the
        # client span of this call ends with the call.
        while message is not _EOF:
            held.add(message)
            is_last = message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
            if is_last or len(held.token_ids) >= settings.check_tokens:
                verdict = await upstreams.check_output(
                    held.full_text,
                    settings.prompt_text,
                    settings.tenant,
                    settings.safety_policy,
                    settings.safety_timeout_s,
                )
                is_blocked = verdict.decision == safety_pb2.DECISION_BLOCK
                if is_blocked or (verdict.waived and not has_audited_waiver):
                    has_audited_waiver = True
                    await audit("output", verdict)
                if is_blocked:
                    await _abandon(call)
                    record_verdict("output", verdict)
                    usage = _usage_so_far(message, held, settings)
                    for blocked in blocked_messages(verdict.safe_message, settings, usage):
                        yield blocked
                    return
                if (delta := held.release()) is not None:
                    yield delta
            if is_last:
                final = message
            message = await call.read()
    except grpc.aio.AioRpcError as error:
        raise upstream_error("engine", error) from None
    finally:
        call.cancel()
    if final is None:
        raise Unavailable("engine ended the stream without a final message; retry the request")
    _record_finish(final)
    yield final_message(_FINISH_FROM_ENGINE[final.finish_reason], settings, final.usage)


def _usage_so_far(
    message: engine_pb2.GenerateResponse, held: HeldOutput, settings: RelaySettings
) -> engine_pb2.Usage:
    """The engine's usage on its last message; before that, what the gateway has seen (a block
    mid-stream still reports and charges the tokens generated until then)."""
    if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
        return message.usage
    return engine_pb2.Usage(prompt_tokens=settings.prompt_tokens, completion_tokens=held.num_tokens)


async def _abandon(call: grpc.aio.UnaryStreamCall) -> None:
    """Cancels the engine call (freeing its KV) and reads the stream out so its span ends."""
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        while await call.read() is not _EOF:
            pass


def record_verdict(layer: str, verdict: safety_pb2.CheckResponse) -> None:
    """Puts a safety verdict on the current span: decision, per-category scores, and a block event."""
    span = trace.get_current_span()
    is_blocked = verdict.decision == safety_pb2.DECISION_BLOCK
    span.set_attribute(f"thermocline.safety.{layer}.decision", "block" if is_blocked else "allow")
    span.set_attribute(f"thermocline.safety.{layer}.policy_version", verdict.policy_version)
    for score in verdict.scores:
        span.set_attribute(f"thermocline.safety.{layer}.score.{score.category}", score.score)
    if is_blocked:
        span.add_event(
            "safety.block",
            {"thermocline.safety.layer": layer, "thermocline.safety.reasons": list(verdict.reasons)},
        )


def _record_finish(message: engine_pb2.GenerateResponse) -> None:
    span = trace.get_current_span()
    span.set_attribute("gen_ai.usage.input_tokens", message.usage.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", message.usage.completion_tokens)
    span.set_attribute(
        "gen_ai.response.finish_reasons", [engine_pb2.FinishReason.Name(message.finish_reason).lower()[14:]]
    )
