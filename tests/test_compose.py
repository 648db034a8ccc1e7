"""compose.yaml and deploy/prometheus.yml: the deployment wiring that no service test exercises.

The structural tests run `docker-compose config` (the v1 tool is enough; no Docker engine is needed)
and check its normalised output, so anchors, merge keys and interpolation are already resolved.
The health-probe tests run the probe from compose.yaml against a real gRPC health server. Where a
service's Kubernetes readinessProbe reads a named gRPC health status (deploy/k8s/base), compose's
healthcheck reads the same one.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.conftest import skip_unless_ci
from thermocline.engine.v1 import engine_pb2

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
PROMETHEUS_FILE = REPO_ROOT / "deploy" / "prometheus.yml"
K8S_BASE = REPO_ROOT / "deploy" / "k8s" / "base"
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
THERMOCLINE_SERVICES = ("gateway", "engine", "safety", "kvstore")
GRPC_READINESS_SERVICES = ("engine", "safety", "kvstore")  # the gateway's k8s readiness is HTTP /ready
SUPPORT_SERVICES = ("redis", "jaeger", "prometheus")
MIN_ENGINE_START_PERIOD_S = 120  # the engine loads (and on first start downloads) a model

Service = dict[str, Any]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml as `docker-compose config` normalises it."""
    tool = shutil.which("docker-compose")
    if tool is None:
        skip_unless_ci("docker-compose is not installed (Debian/Ubuntu: apt-get install docker-compose)")
    result = subprocess.run(
        [tool, "-f", str(COMPOSE_FILE), "config"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def service(compose: dict[str, Any], name: str) -> Service:
    """One service's normalised definition."""
    return compose["services"][name]


def env_of(svc: Service) -> dict[str, str]:
    """A service's environment as a name -> value mapping."""
    return {name: str(value) for name, value in svc.get("environment", {}).items()}


def env_var(name: str, key: str) -> str:
    """`THERMOCLINE_<NAME>_<KEY>`."""
    return f"THERMOCLINE_{name.upper()}_{key}"


def duration_s(text: str) -> float:
    """A compose duration such as `5m`, `1m30s` or `500ms`, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"unparsable duration {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def named_volume_at(compose: dict[str, Any], svc: Service, target: str) -> str | None:
    """The named volume that `svc` mounts at `target`, if any."""
    for mount in svc.get("volumes", []):
        if isinstance(mount, str):
            source, _, rest = mount.partition(":")
            mount = {"type": "volume", "source": source, "target": rest.split(":")[0]}
        if mount.get("target") == target and mount.get("source") in compose.get("volumes", {}):
            return mount["source"]
    return None


def test_defines_the_four_services_and_their_support(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {*THERMOCLINE_SERVICES, *SUPPORT_SERVICES}


@pytest.mark.parametrize("name", THERMOCLINE_SERVICES)
def test_service_runs_its_module_and_listens_beyond_loopback(compose: dict[str, Any], name: str) -> None:
    svc = service(compose, name)
    assert svc["command"] == ["python", "-m", f"services.{name}"]
    env = env_of(svc)
    assert env[env_var(name, "HOST")] == "0.0.0.0", "a loopback bind is unreachable from other containers"
    assert int(env[env_var(name, "METRICS_PORT")]) > 0
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


@pytest.mark.parametrize("name", THERMOCLINE_SERVICES)
def test_service_healthcheck_probes_its_own_grpc_port(compose: dict[str, Any], name: str) -> None:
    svc = service(compose, name)
    test = svc["healthcheck"]["test"]
    port = env_of(svc)[env_var(name, "PORT")]
    assert test[:3] == ["CMD", "python", "-c"]
    assert "grpc_health.v1" in test[3]
    assert test[4] == f"127.0.0.1:{port}"


def k8s_readiness_probe(name: str) -> dict[str, Any]:
    """The readinessProbe of the workload `name` in deploy/k8s/base/<name>.yaml."""
    documents = yaml.safe_load_all((K8S_BASE / f"{name}.yaml").read_text())
    workload = next(d for d in documents if d and d["kind"] in ("Deployment", "StatefulSet"))
    return workload["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]  # type: ignore[no-any-return]


def probed_health_name(svc: Service) -> str:
    """The grpc.health.v1 name a service's compose healthcheck asks about ("" is the whole server)."""
    test = svc["healthcheck"]["test"]
    return test[5] if len(test) > 5 else ""


@pytest.mark.parametrize("name", GRPC_READINESS_SERVICES)
def test_service_healthcheck_reads_the_health_name_k8s_readiness_reads(
    compose: dict[str, Any], name: str
) -> None:
    """The gateway starts once its dependencies are healthy: for the engine that must mean ready (its
    service name, NOT_SERVING while its safety gate refuses every Generate), not merely live ("")."""
    readiness = k8s_readiness_probe(name)["grpc"]
    assert probed_health_name(service(compose, name)) == readiness.get("service", "")


@pytest.mark.parametrize(
    ("name", "dependencies"),
    [
        ("gateway", {"engine", "safety", "redis"}),
        ("engine", {"kvstore", "safety"}),
        ("kvstore", {"redis"}),
    ],
)
def test_service_waits_for_healthy_dependencies(
    compose: dict[str, Any], name: str, dependencies: set[str]
) -> None:
    depends_on = service(compose, name)["depends_on"]
    assert set(depends_on) >= dependencies
    for dependency in dependencies:
        assert depends_on[dependency]["condition"] == "service_healthy", f"{name} -> {dependency}"
        assert "healthcheck" in service(compose, dependency), f"{dependency} can never become healthy"


def test_gateway_targets_engine_and_safety_by_service_name(compose: dict[str, Any]) -> None:
    env = env_of(service(compose, "gateway"))
    engine_port = env_of(service(compose, "engine"))[env_var("engine", "PORT")]
    safety_port = env_of(service(compose, "safety"))[env_var("safety", "PORT")]
    assert env[env_var("gateway", "ENGINE_TARGET")] == f"engine:{engine_port}"
    assert env[env_var("gateway", "SAFETY_TARGET")] == f"safety:{safety_port}"
    assert env["REDIS_URL"].startswith("redis://redis:")


def test_gateway_mounts_the_jwt_public_key_read_only(compose: dict[str, Any]) -> None:
    gateway = service(compose, "gateway")
    key_path = env_of(gateway)[env_var("gateway", "JWT_KEY_FILE")]
    mounts = [m for m in gateway["volumes"] if isinstance(m, dict) and m["target"] == key_path]
    assert len(mounts) == 1, f"nothing is mounted at {key_path}"
    assert mounts[0]["type"] == "bind"
    assert mounts[0]["read_only"] is True
    assert mounts[0]["source"].endswith("deploy/keys/jwt-public.pem")


@pytest.mark.parametrize("name", THERMOCLINE_SERVICES)
def test_service_mounts_the_service_token_read_only(compose: dict[str, Any], name: str) -> None:
    """The engine, safety and kvstore refuse calls without it and, listening beyond loopback, will
    not start without it; the gateway sends it on every internal call."""
    svc = service(compose, name)
    token_path = env_of(svc)["THERMOCLINE_SERVICE_TOKEN_FILE"]
    mounts = [m for m in svc.get("volumes", []) if isinstance(m, dict) and m["target"] == token_path]
    assert len(mounts) == 1, f"{name}: nothing is mounted at {token_path}"
    assert mounts[0]["type"] == "bind" and mounts[0]["read_only"] is True
    assert mounts[0]["source"].endswith("deploy/keys/service.token")


def test_engine_reserves_an_nvidia_gpu(compose: dict[str, Any]) -> None:
    devices = service(compose, "engine")["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_engine_health_allows_for_model_loading(compose: dict[str, Any]) -> None:
    start_period = service(compose, "engine")["healthcheck"]["start_period"]
    assert duration_s(start_period) >= MIN_ENGINE_START_PERIOD_S


def test_engine_caches_models_in_a_named_volume(compose: dict[str, Any]) -> None:
    engine = service(compose, "engine")
    cache_dir = env_of(engine)["THERMOCLINE_CACHE_DIR"]
    assert named_volume_at(compose, engine, cache_dir) is not None


def test_kvstore_keeps_its_data_in_a_named_volume(compose: dict[str, Any]) -> None:
    kvstore = service(compose, "kvstore")
    data_dir = env_of(kvstore)[env_var("kvstore", "DATA_DIR")]
    assert named_volume_at(compose, kvstore, data_dir) is not None
    assert env_of(kvstore)["REDIS_URL"].startswith("redis://redis:")


@pytest.mark.parametrize("name", SUPPORT_SERVICES)
def test_support_images_are_pinned(compose: dict[str, Any], name: str) -> None:
    image = service(compose, name)["image"]
    _, _, tag = image.rpartition(":")
    assert "/" not in tag and re.search(r"\d", tag), f"{image} has no version tag"


def test_redis_has_a_healthcheck(compose: dict[str, Any]) -> None:
    assert service(compose, "redis")["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_jaeger_accepts_otlp(compose: dict[str, Any]) -> None:
    assert env_of(service(compose, "jaeger"))["COLLECTOR_OTLP_ENABLED"] == "true"


def test_prometheus_mounts_the_scrape_config(compose: dict[str, Any]) -> None:
    volumes = service(compose, "prometheus")["volumes"]
    source = f"{PROMETHEUS_FILE}:/etc/prometheus/prometheus.yml"
    assert any(isinstance(v, str) and v.startswith(source) for v in volumes), volumes


def test_prometheus_scrapes_every_metrics_port(compose: dict[str, Any]) -> None:
    # safety is found by DNS, each replica labelled as the static targets are (job and service)
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    # a service that may run as several replicas is found by its DNS records, each on its port
    targets |= {
        f"{name}:{dns['port']}"
        for job in config["scrape_configs"]
        for dns in job.get("dns_sd_configs", [])
        for name in dns["names"]
    }
    for name in THERMOCLINE_SERVICES:
        metrics_port = env_of(service(compose, name))[env_var(name, "METRICS_PORT")]
        assert f"{name}:{metrics_port}" in targets


# The probe itself, run as compose would run it, against a real health server.


def health_probe_argv(address: str, name: str = "gateway") -> list[str]:
    """Service `name`'s compose healthcheck command, with this interpreter and `address`."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # PyYAML resolves the anchors and merge keys
    test = raw["services"][name]["healthcheck"]["test"]
    return [sys.executable, *test[2:4], address, *test[5:]]


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A gRPC server with only the health service, on a free loopback port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def run_probe(address: str, name: str = "gateway") -> int:
    """The exit status of service `name`'s probe."""
    argv = health_probe_argv(address, name)
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode


def test_health_probe_passes_when_serving(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run_probe(address) == 0


def test_health_probe_fails_when_not_serving(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_probe(address) != 0


def test_health_probe_fails_when_nothing_listens() -> None:
    with socket.socket() as held:  # bound but not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        assert run_probe(f"127.0.0.1:{held.getsockname()[1]}") != 0


def test_engine_probe_fails_while_live_but_not_ready(
    health_server: tuple[str, health.HealthServicer],
) -> None:
    """An engine whose safety gate refuses: "" SERVING (live), its service name NOT_SERVING."""
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_probe(address, "engine") != 0
    servicer.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING)  # the gate matches again
    assert run_probe(address, "engine") == 0
