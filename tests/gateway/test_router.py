"""A replica's health following against a real gRPC health server that goes away and comes back.

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
from services.gateway.router import Replica

NUM_FAILED_ATTEMPTS = 4
BACK_WITHIN_S = 2.0  # a generous bound over the 0.5 s backoff cap; the default backoff overshoots it


async def _health_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server


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
