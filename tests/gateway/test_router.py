"""A replica's health following against real gRPC health servers: one that goes away and comes
back, and ones whose readiness (the engine service's name) differs from their liveness ("").

While the replica is away, its port is held by a plain socket that accepts each connection and
closes it at once, so the test counts the channel's reconnect attempts instead of waiting out a
clock. gRPC's default backoff spaced the fifth attempt about 4 s after the fourth (and later ones
up to 120 s apart); capped at 0.5 s, a replica that is back is followed within the bound below.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli.mesh import free_port
from services.gateway.config import RoutingConfig
from services.gateway.router import ENGINE_SERVICE, Replica, Router

NUM_FAILED_ATTEMPTS = 4
BACK_WITHIN_S = 2.0  # a generous bound over the 0.5 s backoff cap; the default backoff overshoots it


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _health_server(port: int) -> grpc.aio.Server:
    server, _ = await _health_servicer(port)
    return server


async def _health_servicer(port: int) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:  # type: ignore[name-defined]
    """A health server whose "" is SERVING; it knows no other name until the test sets one."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set("", SERVING)
    return server, servicer


async def _refuse_connections(port: int, num_attempts: int) -> None:
    """Holds the port and hangs up on `num_attempts` connections, then lets the port go."""
    listener = socket.create_server(("127.0.0.1", port), reuse_port=True)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(num_attempts):
            connection, _ = await loop.sock_accept(listener)
            connection.close()
    finally:
        listener.close()


async def _wait_until(predicate: object, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


def test_a_replica_that_comes_back_is_followed_within_a_second_or_two() -> None:
    async def scenario() -> bool:
        port = free_port()
        server = await _health_server(port)
        replica = Replica(f"127.0.0.1:{port}")
        follower = asyncio.create_task(replica.follow_health())
        try:
            await _wait_until(lambda: replica.is_serving)
            await server.stop(None)
            await _wait_until(lambda: not replica.is_serving)
            await _refuse_connections(port, NUM_FAILED_ATTEMPTS)
            server = await _health_server(port)
            try:
                await _wait_until(lambda: replica.is_serving, BACK_WITHIN_S)
            except TimeoutError:
                return False
            return True
        finally:
            follower.cancel()
            await replica.channel.close(None)
            await server.stop(None)

    assert asyncio.run(scenario()), f"the replica was back, but not followed within {BACK_WITHIN_S} s"


def test_ready_replicas_are_preferred_then_live_ones_and_a_draining_one_is_left_out() -> None:
    async def scenario() -> None:
        older_port, gated_port = free_port(), free_port()
        older, older_health = await _health_servicer(older_port)  # knows only "": counts as ready
        gated, gated_health = await _health_servicer(gated_port)
        await gated_health.set(ENGINE_SERVICE, SERVING)
        router = Router(RoutingConfig(engine_targets=(f"127.0.0.1:{older_port}", f"127.0.0.1:{gated_port}")))
        old_replica, gated_replica = router.replicas
        await router.start()
        try:
            await _wait_until(lambda: all(r.is_serving and r.is_ready for r in router.replicas))
            await gated_health.set(ENGINE_SERVICE, NOT_SERVING)  # e.g. its safety gate now refuses
            await _wait_until(lambda: not gated_replica.is_ready)
            assert gated_replica.is_serving  # live: no restart, and no traffic while another is ready
            assert router.routable() == [old_replica]
            assert router.candidates(b"any prefix", "interactive") == [old_replica]

            await older_health.enter_graceful_shutdown()  # draining: every name NOT_SERVING
            await _wait_until(lambda: not old_replica.is_serving)
            assert router.routable() == [gated_replica]  # its refusal names the gate: not UNAVAILABLE

            await gated_health.set(ENGINE_SERVICE, SERVING)  # the re-check lifted the refusal
            await _wait_until(lambda: gated_replica.is_ready)
            assert router.routable() == [gated_replica]
        finally:
            await router.close()
            await older.stop(None)
            await gated.stop(None)

    asyncio.run(scenario())
