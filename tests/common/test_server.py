"""The shared server runner: health says SERVING only once the service's own start-up is done,
and the service's own name (readiness) follows a readiness probe that the server's "" (liveness) ignores."""

from __future__ import annotations

import asyncio

import grpc
import pytest
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


SERVICE = "thermocline.test.v1.ProbedService"


class Probes:
    """A service's health and readiness problems, set by the test, and how often they were asked."""

    def __init__(self, readiness: str | None = None) -> None:
        self.health: str | None = None
        self.readiness = readiness
        self.num_asked = 0
        self._asked = asyncio.Event()

    def ask_health(self) -> str | None:
        return self.health

    def ask_readiness(self) -> str | None:
        self.num_asked += 1
        self._asked.set()
        return self.readiness

    async def published(self) -> None:
        """Returns once a probe round that began after this call has published its statuses: the
        runner asks both probes, then publishes, then sleeps, so the second ask from now follows it."""
        target = self.num_asked + 2
        while self.num_asked < target:
            self._asked.clear()
            await self._asked.wait()


def test_readiness_turns_only_the_service_names_not_serving_and_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's "" (liveness) follows the health probe only; the service's own name (readiness)
    follows both, and a health probe that recovers does not lift a readiness problem."""
    monkeypatch.setattr("services.common.server.HEALTH_PROBE_INTERVAL_S", 0.01)

    async def scenario() -> list[tuple[int, int]]:
        probes = Probes(readiness="its gate refuses every Generate")
        port = free_port()
        spec = ServiceSpec(
            config=ServerConfig(service="probe", port=port),
            register=lambda server: [SERVICE],
            health_probe=probes.ask_health,
            readiness_probe=probes.ask_readiness,
        )
        running = RunningServer(spec)
        await running.start()
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def statuses() -> tuple[int, int]:
                replies = [
                    await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                    for name in ("", SERVICE)
                ]
                return replies[0].status, replies[1].status

            seen.append(await statuses())  # not ready from the start: never a SERVING in between
            probes.readiness = None
            await probes.published()
            seen.append(await statuses())
            probes.health, probes.readiness = "the step thread died", "its gate refuses every Generate"
            await probes.published()
            seen.append(await statuses())
            probes.health = None  # health recovers, readiness does not
            await probes.published()
            seen.append(await statuses())
            probes.readiness = None  # e.g. the gate re-check found safety's gate
            await probes.published()
            seen.append(await statuses())
        await running.server.stop(None)
        return seen

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [
        (serving, not_serving),
        (serving, serving),
        (not_serving, not_serving),
        (serving, not_serving),
        (serving, serving),
    ]
