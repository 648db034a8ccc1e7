"""Relaying one request to an engine replica, and its token stream back through the output screen.

Which replica, and when a request may move to another, is here; how its text is released against
the output screen (strict, growing or trailing) is in output_screen.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.gateway.output_screen import (
    CompletionCounted,
    RelaySettings,
    VerdictAudit,
    ignore_count,
    no_audit,
    screened,
)
from services.gateway.router import Replica
from services.gateway.upstream import Upstreams, upstream_error
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb

# How long a request waits for a replica that is not (yet) serving before trying it anyway.
RECONNECT_WAIT_S = 2.0
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end-of-stream sentinel of call.read()


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
    audit: VerdictAudit = no_audit,
    on_counted: CompletionCounted = ignore_count,
) -> AsyncIterator[pb.GenerateResponse]:
    """Streams the engine's answer to `request`, released against the output screen.

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
        # Closing the relay closes the screened stream there and then (its `finally` ends the
        # engine call), not later through the loop's async-generator finalizer.
        async with contextlib.aclosing(
            screened(upstreams, call, first, settings, audit, on_counted)
        ) as stream:
            async for message in stream:
                yield message
        return
    assert last_error is not None
    raise upstream_error("engine", last_error)


async def _first_message(call: grpc.aio.UnaryStreamCall) -> Any:
    """The first message of the engine stream (or EOF); _Unstarted when retrying is safe."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as error:
        # UNAVAILABLE: draining or gone. FAILED_PRECONDITION: the replica refuses every request
        # (its safety gate differs from the safety service's); another replica may not.
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
            raise _Unstarted(error) from None
        raise upstream_error("engine", error) from None
