"""Client channels between services: traced, authenticated, with the shared limits and keepalive."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import telemetry
from services.common.config import channel_options
from services.common.service_auth import ServiceToken, authenticated_aio, token_from_env

# gRPC's default reconnect backoff grows to 120 s (1 s, 1.6 s, 2.6 s, ...): a service restarted after a
# few seconds' absence would sit unreachable for up to 15 s after it reports SERVING. Between our
# own services on a LAN, retrying a connection twice a second costs nothing.
RECONNECT_BACKOFF_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def open_channel(
    target: str,
    max_message_bytes: int = 16 * 1024 * 1024,
    *,
    trace_calls: bool = True,
    service_token: ServiceToken | None = None,
    extra_options: list[tuple[str, str | int]] | None = None,
) -> grpc.aio.Channel:
    """An insecure aio channel to `target` whose calls carry the current trace context and the
    service token (`service_token`, or by default this process's, from THERMOCLINE_SERVICE_TOKEN_FILE;
    none when that is unset). With `trace_calls=False` it has no interceptors, and its stubs are
    traced by telemetry.traced_stub. `extra_options`: more gRPC channel arguments (a load-balancing
    policy, say)."""
    channel = grpc.aio.insecure_channel(
        target,
        options=channel_options(max_message_bytes) + RECONNECT_BACKOFF_OPTIONS + (extra_options or []),
        interceptors=telemetry.client_interceptors() if trace_calls else None,
    )
    return authenticated_aio(channel, service_token or token_from_env())


async def health_status(target: str, service: str = "", timeout_s: float = 1.0) -> int | None:
    """The health status of `service` at `target`, or None when it does not answer."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return int(reply.status)


async def wait_until_serving(target: str, timeout_s: float, service: str = "") -> None:
    """Waits on health checks until `target` reports SERVING; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await health_status(target, service) == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{target} did not report SERVING within {timeout_s:.0f} s")
