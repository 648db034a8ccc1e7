"""The shared server runner: health says SERVING only once the service's own start-up is done."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServerConfig
from services.common.ports import free_port
from services.common.server import RunningServer, ServiceSpec


def test_health_is_not_serving_until_on_start_has_finished() -> None:
    async def scenario() -> list[int]:
        opened = asyncio.Event()
        release = asyncio.Event()

        async def on_start() -> None:  # e.g. the kvstore opening its segments
            opened.set()
            await release.wait()

        port = free_port()
        config = ServerConfig(service="probe", port=port)
        running = RunningServer(ServiceSpec(config=config, register=lambda server: [], on_start=on_start))
        starting = asyncio.create_task(running.start())
        await opened.wait()  # the port is bound and on_start is running
        statuses = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            statuses.append(reply.status)
            release.set()
            await starting
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            statuses.append(reply.status)
        await running.server.stop(None)
        return statuses

    serving = health_pb2.HealthCheckResponse
    assert asyncio.run(scenario()) == [serving.NOT_SERVING, serving.SERVING]
