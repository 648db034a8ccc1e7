"""The grpc.aio server runner every service uses: health, reflection, limits, telemetry, drain.

A service hands `run_service` its config and a function that registers its servicers. The
runner serves until SIGTERM or SIGINT, then drains: health turns NOT_SERVING at once, new
calls get UNAVAILABLE, and calls in flight get `grace_s` seconds to finish.

Health has two audiences. The server's name ("") is for liveness: it follows the drain and the
service's health probe only, so a restart is asked for only where a restart can mend something.
Each service's own name (e.g. "thermocline.engine.v1.EngineService") is for readiness: it is also
NOT_SERVING while the readiness probe gives a reason, e.g. an engine whose safety gate refuses
every Generate, which a restart would reload as it is.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import telemetry
from services.common.config import ServerConfig, channel_options
from services.common.gc_pauses import freeze_start_up_heap, watch_gc_pauses
from services.common.interceptors import CallTracker, GuardInterceptor
from services.common.metrics import DRAINING, start_metrics_server
from services.common.redaction import RedactingFormatter
from services.common.service_auth import ServiceToken, server_interceptors, warn_if_open

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]
HEALTH_PROBE_INTERVAL_S = 1.0
CUT_WAIT_S = 5.0  # how long calls ended by on_grace_over get to send their status


@dataclass
class ServiceSpec:
    """What a service brings to the runner."""

    config: ServerConfig
    # Adds the servicers to the server; returns their full names (e.g. "thermocline.engine.v1.EngineService").
    register: Callable[[grpc.aio.Server], list[str]]
    # Runs after the port is bound and before health turns SERVING.
    on_start: Hook | None = None
    # Runs after the server has stopped.
    on_stop: Hook | None = None
    # Runs when the drain's grace period ends with calls in flight: a chance to end them with a
    # status that says so (and report which) before the server cancels what is left.
    on_grace_over: Hook | None = None
    # Calls the service serves besides its gRPC server's (the gateway's HTTP front), counted by the
    # service: the drain waits for them as for its gRPC calls, within the grace period and for
    # CUT_WAIT_S after on_grace_over, which ends them too.
    other_calls: list[CallTracker] = field(default_factory=list)
    # Extra state the service wants reflected in its health status.
    service_names: list[str] = field(default_factory=list)
    # Polled every HEALTH_PROBE_INTERVAL_S while serving: None when healthy, else why not. A reason
    # turns health NOT_SERVING (so routers move traffic away) until the probe says None again.
    health_probe: Callable[[], str | None] | None = None
    # Polled with health_probe: None when the service should get traffic, else why not. A reason
    # turns only the service names NOT_SERVING (readiness); the server's "" (liveness) stays.
    readiness_probe: Callable[[], str | None] | None = None
    # gRPC server options on top of the shared ones (channel_options), e.g. the gateway's
    # ("grpc.http2.bdp_probe", 0).
    server_options: list[tuple[str, int]] = field(default_factory=list)


def setup_logging(level: str) -> None:
    """One log format for all services: time, service logger, level, message; credentials redacted."""
    logging.basicConfig(level=level.upper())
    formatter = RedactingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


class Problems(NamedTuple):
    """What the service's probes last said: None where all is well, else why not."""

    health: str | None = None  # turns every health name NOT_SERVING
    readiness: str | None = None  # turns the service names NOT_SERVING, not ""


def _ask(probe: Callable[[], str | None] | None) -> str | None:
    return None if probe is None else probe()


def _status(problem: str | None) -> int:
    if problem is None:
        return health_pb2.HealthCheckResponse.SERVING
    return health_pb2.HealthCheckResponse.NOT_SERVING


class RunningServer:
    """A started server plus what the drain needs to reach."""

    def __init__(self, spec: ServiceSpec, freeze_heap: bool = False) -> None:
        self.spec = spec
        # A service process freezes its start-up heap (gc_pauses.py); a test that runs a server
        # inside its own process does not, or it would freeze the test's objects for good.
        self.freeze_heap = freeze_heap
        self.tracker = CallTracker()
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.server = grpc.aio.server(
            # the token check runs inside the guard, which counts and traces its refusals
            interceptors=[GuardInterceptor(self.tracker), *server_interceptors(self._checked_token())],
            options=channel_options(spec.config.max_message_bytes, spec.config.keepalive_s)
            + spec.server_options,
        )
        self.stopped = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None

    def _checked_token(self) -> ServiceToken | None:
        """The token callers must present: none on the gateway's public port, whose callers bring JWTs."""
        config = self.spec.config
        return None if config.is_public else config.service_token

    async def start(self) -> None:
        """Registers everything, binds the port and turns health SERVING."""
        config = self.spec.config
        if not config.is_public:
            warn_if_open(config.service, config.service_token)
        self.spec.service_names = self.spec.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflected = [*self.spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(reflected, self.server)
        if self.server.add_insecure_port(config.address) == 0:
            raise OSError(f"{config.service}: cannot bind {config.address}; is the port taken?")
        # grpc's health servicer starts with the whole server ("") SERVING: say NOT_SERVING until
        # on_start is done, or a caller that waits for health races the service's own start-up
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.spec.on_start is not None:
            await self.spec.on_start()
        if self.freeze_heap:
            freeze_start_up_heap()  # what start-up built, no later collection walks again
        problems = self._ask_probes()  # a service not ready at start never says SERVING
        self._log_problems(Problems(), problems)
        await self._publish(problems)
        log.info("%s serving on %s", config.service, config.address)
        if self.spec.health_probe is not None or self.spec.readiness_probe is not None:
            self._probe_task = asyncio.create_task(self._follow_probes(problems))

    def _ask_probes(self) -> Problems:
        return Problems(_ask(self.spec.health_probe), _ask(self.spec.readiness_probe))

    async def _follow_probes(self, last: Problems) -> None:
        """Mirrors the service's probes in its health statuses until the drain takes over."""
        while not self.tracker.is_draining:
            await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)
            problems = self._ask_probes()
            if problems != last and not self.tracker.is_draining:
                self._log_problems(last, problems)
                await self._publish(problems)
                last = problems

    async def _publish(self, problems: Problems) -> None:
        """Each service name follows both probes; the server's "" follows the health probe, and is
        set last, so a caller that saw "" change finds the service names already set."""
        service_status = _status(problems.health or problems.readiness)
        for name in self.spec.service_names:
            await self.health.set(name, service_status)
        await self.health.set("", _status(problems.health))

    def _log_problems(self, last: Problems, problems: Problems) -> None:
        service = self.spec.config.service
        if problems.health != last.health:
            if problems.health is None:
                log.info("%s is healthy again", service)
            else:
                log.error("%s is not serving: %s", service, problems.health)
        if problems.readiness != last.readiness:
            if problems.readiness is None:
                log.info("%s is ready again", service)
            else:
                log.error("%s is not ready (live, but no traffic): %s", service, problems.readiness)

    async def drain(self) -> None:
        """Stops admitting calls, lets those in flight finish within the grace period, then stops."""
        if self.tracker.is_draining:
            return
        grace_s = self.spec.config.grace_s
        self.tracker.is_draining = True
        DRAINING.set(1)
        # every name NOT_SERVING for good: a probe's set still in flight cannot turn one back
        await self.health.enter_graceful_shutdown()
        log.info("draining: %d call(s) in flight, grace %.1f s", self._num_in_flight(), grace_s)
        if not await self.tracker.wait_idle(grace_s, *self.spec.other_calls):
            log.warning("grace period over with %d call(s) in flight; cancelling them", self._num_in_flight())
            if self.spec.on_grace_over is not None:
                await self.spec.on_grace_over()
                await self.tracker.wait_idle(CUT_WAIT_S, *self.spec.other_calls)
        # Only infrastructure calls (health Watch streams, reflection) can be left now: no new
        # application call was admitted while draining, so stop at once rather than wait them out.
        await self.server.stop(0)
        if self.spec.on_stop is not None:
            await self.spec.on_stop()
        self.stopped.set()

    def _num_in_flight(self) -> int:
        return self.tracker.num_in_flight + sum(calls.num_in_flight for calls in self.spec.other_calls)

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.spec.service_names]:
            await self.health.set(name, status)


async def serve(spec: ServiceSpec) -> None:
    """Runs the service until a signal has drained it."""
    running = RunningServer(spec, freeze_heap=True)
    await running.start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(running.drain()))
    await running.stopped.wait()


def run_service(spec: ServiceSpec) -> None:
    """The entry point of a service process: logging, tracing, metrics, then serve."""
    config = spec.config
    setup_logging(config.log_level)
    telemetry.setup_tracing(config.service)
    start_metrics_server(config.host, config.metrics_port)
    watch_gc_pauses()
    try:
        asyncio.run(serve(spec))
    finally:
        telemetry.shutdown_tracing()
