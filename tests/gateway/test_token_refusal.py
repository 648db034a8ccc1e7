"""A gateway whose service token its engine or safety service refuses: THERMOCLINE_SERVICE_TOKEN_FILE
names another token on each side. Their health checks stay open, so only calls that carry the
token see it: the router's GetStats poll marks the replica as refusing (live, but not serving),
the gateway's /ready says 503 naming the setting, its gRPC readiness (the service's name, not "")
turns NOT_SERVING, thermocline_gateway_upstream_token_refused_seconds rises for that target and
one ERROR names it and the setting; a caller hears UNAVAILABLE saying that no usable
engine (or safety service) is reachable, not "retry later". Once the tokens match, the next poll
makes the gateway ready again, without a restart of the gateway. The safety service is polled too
(GetGate): a gateway whose safety service refuses its token turns not ready with no request sent."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.common.errors import ThermoclineError
from services.common.ports import free_port
from services.common.service_auth import METADATA_KEY, TOKEN_FILE_SETTING, ensure_token_file
from services.gateway.config import RoutingConfig
from services.gateway.router import Router
from services.gateway.upstream import Upstreams
from tests.conftest import holding_service_token
from tests.gateway.conftest import call, refusal, token
from tests.gateway.test_router import _wait_until
from tests.health import watch_until
from thermocline.gateway.v1 import gateway_pb2
from thermocline.safety.v1 import safety_pb2

GAUGE = "thermocline_gateway_upstream_token_refused_seconds"
REFUSAL_LOGGED = "refuses this gateway's service token"
NO_USABLE = "the gateway cannot reach a usable"
WAIT_S = 30.0
NO_POLICY = safety_pb2.TenantPolicy()
POLL_INTERVAL_S = 0.05  # the in-process router's: one second of refusals is about 20 polls
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name  # readiness
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NOT_SERVING_YET = "no engine replica is serving yet"  # /ready's reason while none is live
SAFETY_REFUSED = "the safety service refuses this gateway's service token"  # ... while safety refuses it


@pytest.fixture(scope="module")
def mesh(stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Redis, safety and an engine, all on the mesh's own service token."""
    state_dir = tmp_path_factory.mktemp("token-refusal")
    settings = {"THERMOCLINE_ENGINE_KVSTORE_TARGET": ""}  # no kvstore: no cold tier
    mesh = Mesh(MeshConfig(str(stories_model), state_dir, Ports.free(), env=settings))
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        for service in ("redis", "safety", "engine"):
            mesh.start_service(service)
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def other_token(mesh: Mesh) -> Path:
    """A token no service of the mesh reads, whatever the tests below switch them to."""
    return ensure_token_file(mesh.keys_dir / "other.token")


def _refusals_logged(messages: list[str], target: str) -> list[str]:
    return [m for m in messages if REFUSAL_LOGGED in m and target in m]


def _services_token(mesh: Mesh) -> Path:
    """The token file the mesh's services read now (the last test switches them to another)."""
    return Path(mesh.config.env.get(TOKEN_FILE_SETTING, str(mesh.service_token_path)))


def _assert_generic(message: str) -> None:
    """The caller's message says no usable upstream is reachable, and nothing of the mesh's setup."""
    assert any(f"{NO_USABLE} {service}:" in message for service in ("engine", "safety")), message
    assert "retry later" not in message, message
    assert TOKEN_FILE_SETTING not in message and METADATA_KEY not in message and "/" not in message, message


def test_a_replica_that_refuses_our_token_is_live_but_not_serving_and_logged_once(
    mesh: Mesh, other_token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = mesh.target("engine")
    labels = {"upstream": "engine", "target": engine}

    async def scenario() -> None:
        with holding_service_token(other_token):  # the router here calls as a gateway on another token
            router = Router(RoutingConfig(engine_targets=(engine,), stats_interval_s=POLL_INTERVAL_S))
        (replica,) = router.replicas
        await router.start()
        try:
            await _wait_until(lambda: replica.is_live and replica.token.refused_s() > 1.0, WAIT_S)
            assert not replica.is_serving
            assert router.routable() == [replica]  # the only one: a caller's error comes from it
            assert (REGISTRY.get_sample_value(GAUGE, labels) or 0.0) > 1.0
        finally:
            await router.close()

    caplog.set_level(logging.INFO, logger="services.gateway.metrics")
    asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    (logged,) = _refusals_logged(errors, engine)  # about 20 refused polls, one line
    assert TOKEN_FILE_SETTING in logged, logged


def test_a_replica_that_takes_our_token_is_serving(mesh: Mesh) -> None:
    engine = mesh.target("engine")

    async def scenario() -> None:
        with holding_service_token(_services_token(mesh)):
            router = Router(RoutingConfig(engine_targets=(engine,), stats_interval_s=POLL_INTERVAL_S))
        (replica,) = router.replicas
        await router.start()
        try:
            await _wait_until(lambda: replica.is_live, WAIT_S)
            await replica.poll_stats(WAIT_S)
            assert replica.is_serving and not replica.token.is_refused
            assert REGISTRY.get_sample_value(GAUGE, {"upstream": "engine", "target": engine}) == 0.0
        finally:
            await router.close()

    asyncio.run(scenario())


def test_safety_refusing_our_token_is_logged_once_and_the_caller_told_generically(
    mesh: Mesh, other_token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    safety = mesh.target("safety")

    async def scenario() -> list[ThermoclineError]:
        with holding_service_token(other_token):
            upstreams = Upstreams(Router(RoutingConfig(engine_targets=(mesh.target("engine"),))), safety)
        failures = []
        try:
            for _ in range(3):
                with pytest.raises(ThermoclineError) as raised:
                    await upstreams.check_prompt("Once upon a time", "acme", NO_POLICY, WAIT_S)
                failures.append(raised.value)
            assert upstreams.safety_token.is_refused
            assert (REGISTRY.get_sample_value(GAUGE, {"upstream": "safety", "target": safety}) or 0.0) > 0
        finally:
            await upstreams.close()
        return failures

    caplog.set_level(logging.INFO, logger="services.gateway.metrics")
    for failure in asyncio.run(scenario()):
        assert failure.code == grpc.StatusCode.UNAVAILABLE, failure
        assert failure.message.startswith(f"{NO_USABLE} safety:"), failure.message
        _assert_generic(failure.message)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    (logged,) = _refusals_logged(errors, safety)  # three refused checks, one line
    assert TOKEN_FILE_SETTING in logged, logged


def test_safety_refusing_our_token_is_seen_by_the_poll_with_no_call_sent(
    mesh: Mesh, other_token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No CheckPrompt or CheckOutput: the gateway's own GetGate poll finds the refusal, and the
    readiness problem names the safety service's token (not its address)."""
    safety = mesh.target("safety")

    async def scenario() -> str | None:
        with holding_service_token(other_token):
            routing = RoutingConfig(engine_targets=(mesh.target("engine"),), stats_interval_s=POLL_INTERVAL_S)
            upstreams = Upstreams(Router(routing), safety)
        await upstreams.start()
        try:
            await _wait_until(lambda: upstreams.safety_token.refused_s() > 1.0, WAIT_S)
            assert (REGISTRY.get_sample_value(GAUGE, {"upstream": "safety", "target": safety}) or 0.0) > 1.0
            return upstreams.readiness_problem()
        finally:
            await upstreams.close()

    caplog.set_level(logging.INFO, logger="services.gateway.metrics")
    problem = asyncio.run(scenario()) or ""
    assert SAFETY_REFUSED in problem and TOKEN_FILE_SETTING in problem and safety not in problem, problem
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    (logged,) = _refusals_logged(errors, safety)  # about 20 refused polls, one line
    assert TOKEN_FILE_SETTING in logged, logged


def test_safety_taking_our_token_is_no_readiness_problem(mesh: Mesh) -> None:
    safety = mesh.target("safety")

    async def scenario() -> None:
        with holding_service_token(_services_token(mesh)):
            upstreams = Upstreams(Router(RoutingConfig(engine_targets=(mesh.target("engine"),))), safety)
        await upstreams.start()
        try:
            await upstreams.poll_safety_token(WAIT_S)
            assert not upstreams.safety_token.is_refused
            assert SAFETY_REFUSED not in (upstreams.readiness_problem() or "")
            assert REGISTRY.get_sample_value(GAUGE, {"upstream": "safety", "target": safety}) == 0.0
        finally:
            await upstreams.close()

    asyncio.run(scenario())


def _ready(url: str) -> tuple[int, str]:
    """/ready's status code and, for a 503, its error message ("" for a 200)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]["message"]


def _ready_status(url: str) -> int:
    return _ready(url)[0]


def _health(target: str, service: str) -> int:
    """The gateway's gRPC health for `service` ("" is liveness), asked as a probe: without a token."""
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def _wait_for_health(target: str, service: str, status: int) -> None:
    """Follows the gateway's health Watch for `service` until it reports `status`; fails after WAIT_S."""
    with grpc.insecure_channel(target) as channel:
        if watch_until(channel, service, status, WAIT_S):
            return
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    raise AssertionError(f"the gateway's health for {service!r} was not {name} within {WAIT_S:.0f} s")


def _not_ready_logged(log_path: Path) -> list[str]:
    """The gateway's ERROR lines saying it is not ready (services/common/server.py writes them)."""
    return [line for line in log_path.read_text().splitlines() if " ERROR " in line and "not ready" in line]


def _refused_s(metrics_url: str, target: str, upstream: str = "engine") -> float | None:
    """The gateway's gauge for the `upstream` at `target`, None while it does not export one."""
    with urllib.request.urlopen(metrics_url, timeout=10) as page:
        families = text_string_to_metric_families(page.read().decode())
    for family in families:
        for sample in family.samples:
            if sample.name == GAUGE and sample.labels == {"upstream": upstream, "target": target}:
                return sample.value
    return None


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    """Checks `condition` until it holds; fails naming `what` after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f} s: {what}"
        time.sleep(0.05)


def _restart(mesh: Mesh, service: str) -> None:
    process = mesh.processes[service]
    process.terminate()
    process.wait(60)
    mesh.start_service(service)


def _start_safety(mesh: Mesh, name: str, token_file: Path) -> str:
    """Another safety process, on a port of its own, that reads `token_file`; returns its target."""
    mesh.extra_ports[name] = free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(mesh.config.env, TOKEN_FILE_SETTING, str(token_file))
        mesh.start_service(name)
    return mesh.target(name)


def _stop(mesh: Mesh, name: str) -> None:
    process = mesh.processes.pop(name)
    process.terminate()
    process.wait(60)


def test_a_gateway_with_no_engine_live_is_not_ready_and_told_to_wait(mesh: Mesh) -> None:
    """Nothing listens at its engine target: /ready and the gRPC readiness say to wait for the
    engines (no token is at fault), while liveness stays SERVING."""
    name = "gateway-no-engine"
    target = mesh.start_gateway_replica(name, THERMOCLINE_GATEWAY_ENGINE_TARGETS=f"127.0.0.1:{free_port()}")
    status, message = _ready(mesh.http_url(name).removesuffix("/v1") + "/ready")
    assert status == 503 and NOT_SERVING_YET in message, message
    assert TOKEN_FILE_SETTING not in message, message
    _wait_for_health(target, GATEWAY_SERVICE, NOT_SERVING)
    assert _health(target, "") == SERVING  # a restart would not bring an engine
    (logged,) = _not_ready_logged(mesh.logs_dir / f"{name}.log")
    assert NOT_SERVING_YET in logged, logged


def test_a_gateway_whose_token_safety_refuses_is_not_ready_with_no_call_sent(
    mesh: Mesh, other_token: Path
) -> None:
    """The engine takes the gateway's token, a safety service on another token refuses it: with no
    request sent, the gateway's safety poll turns /ready 503 naming the setting, its gRPC readiness
    NOT_SERVING and the safety gauge up. A gateway beside it whose safety takes the token stays ready."""
    safety_name, matched_name, refused_name = (
        "safety-other-token",
        "gateway-safety-takes",
        "gateway-safety-refuses",
    )
    safety = _start_safety(mesh, safety_name, other_token)
    matched_metrics_port, metrics_port = free_port(), free_port()
    try:
        matched = mesh.start_gateway_replica(
            matched_name,
            THERMOCLINE_GATEWAY_METRICS_PORT=str(matched_metrics_port),
            THERMOCLINE_GATEWAY_ENGINE_STATS_INTERVAL_S="0.1",
        )
        matched_ready_url = mesh.http_url(matched_name).removesuffix("/v1") + "/ready"
        _wait_for(lambda: _ready_status(matched_ready_url) == 200, "the gateway on matching tokens is ready")
        target = mesh.start_gateway_replica(
            refused_name,
            THERMOCLINE_GATEWAY_SAFETY_TARGET=safety,
            THERMOCLINE_GATEWAY_METRICS_PORT=str(metrics_port),
            THERMOCLINE_GATEWAY_ENGINE_STATS_INTERVAL_S="0.1",
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

        _wait_for(lambda: (_refused_s(metrics_url, safety, "safety") or 0.0) > 1.0, "the safety gauge rises")
        status, message = _ready(mesh.http_url(refused_name).removesuffix("/v1") + "/ready")
        assert status == 503, status
        assert SAFETY_REFUSED in message and TOKEN_FILE_SETTING in message, message
        assert safety not in message and NOT_SERVING_YET not in message, message
        _wait_for_health(target, GATEWAY_SERVICE, NOT_SERVING)  # gRPC readiness follows /ready
        assert _health(target, "") == SERVING  # liveness: a restart would read the same token
        assert _refused_s(metrics_url, mesh.target("engine")) == 0.0  # the engine takes it
        not_ready = _not_ready_logged(mesh.logs_dir / f"{refused_name}.log")
        assert any(SAFETY_REFUSED in line and TOKEN_FILE_SETTING in line for line in not_ready), not_ready
        log_lines = (mesh.logs_dir / f"{refused_name}.log").read_text().splitlines()
        (logged,) = _refusals_logged([line for line in log_lines if " ERROR " in line], safety)
        assert TOKEN_FILE_SETTING in logged, logged

        # started first, polled as often: its safety service takes the token, and it stays ready
        assert _ready_status(matched_ready_url) == 200
        assert _health(matched, GATEWAY_SERVICE) == SERVING
        matched_metrics_url = f"http://127.0.0.1:{matched_metrics_port}/metrics"
        assert _refused_s(matched_metrics_url, mesh.target("safety"), "safety") == 0.0
    finally:
        for name in (refused_name, matched_name, safety_name):
            if name in mesh.processes:
                _stop(mesh, name)


def test_a_gateway_whose_token_the_engine_refuses_is_not_ready_until_the_tokens_match(mesh: Mesh) -> None:
    gateway_token = ensure_token_file(mesh.keys_dir / "gateway.token")
    name, metrics_port, engine = "gateway-own-token", free_port(), mesh.target("engine")
    target = mesh.start_gateway_replica(
        name,
        THERMOCLINE_SERVICE_TOKEN_FILE=str(gateway_token),
        THERMOCLINE_GATEWAY_METRICS_PORT=str(metrics_port),
        THERMOCLINE_GATEWAY_ENGINE_STATS_INTERVAL_S="0.1",
    )
    ready_url = mesh.http_url(name).removesuffix("/v1") + "/ready"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    _wait_for(lambda: (_refused_s(metrics_url, engine) or 0.0) > 1.0, "the gauge shows the refusal")
    status, message = _ready(ready_url)  # for the operator: the setting to check, not "wait"
    assert status == 503, status
    assert "service token" in message and TOKEN_FILE_SETTING in message, message
    assert NOT_SERVING_YET not in message and engine not in message, message
    _wait_for_health(target, GATEWAY_SERVICE, NOT_SERVING)  # gRPC readiness follows /ready
    assert _health(target, "") == SERVING  # liveness: a restart would read the same token
    not_ready = _not_ready_logged(mesh.logs_dir / f"{name}.log")
    assert any(TOKEN_FILE_SETTING in line for line in not_ready), not_ready
    refused = refusal(target, token(mesh))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    _assert_generic(refused.details() or "")  # the engine's count or safety's screen, whichever failed first
    log_lines = (mesh.logs_dir / f"{name}.log").read_text().splitlines()
    (logged,) = _refusals_logged([line for line in log_lines if " ERROR " in line], engine)
    assert TOKEN_FILE_SETTING in logged, logged

    # the operator hands safety and the engine the gateway's token; the gateway itself runs on
    mesh.config.env[TOKEN_FILE_SETTING] = str(gateway_token)
    _restart(mesh, "safety")
    _restart(mesh, "engine")
    _wait_for(lambda: _ready_status(ready_url) == 200, "the gateway reports ready")
    _wait_for_health(target, GATEWAY_SERVICE, SERVING)
    assert _refused_s(metrics_url, engine) == 0.0
    assert call(target, token(mesh)).done is not None
    assert _refused_s(metrics_url, mesh.target("safety"), "safety") == 0.0  # it screened the call
