"""deploy/k8s/: every overlay renders with kustomize, and every object it renders is valid offline.

Built-in kinds are checked against the Kubernetes OpenAPI schemas bundled in kubernetes-validate
(strict: an unknown or misspelt field fails); the CRDs the GPU overlay uses (KEDA ScaledObject,
Prometheus Operator PodMonitor and PrometheusRule) against the fields this project relies on.
No cluster is needed. Rendering needs `kubectl` (or `kustomize`) on PATH. Outside CI the rendering
tests skip without one (the checks that read only the source files still run); under CI (`CI=true`)
a missing renderer fails them, so no overlay reaches main unrendered.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import skip_unless_ci
from thermocline.engine.v1 import engine_pb2

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("laptop", "gpu")
KUBERNETES_VERSION = "1.32.0"
# The mesh's own services, each the workload kind it renders as.
SERVICES = (
    ("Deployment", "gateway"),
    ("StatefulSet", "engine"),
    ("Deployment", "safety"),
    ("StatefulSet", "kvstore"),
)
# Config that kustomize must read from inside deploy/k8s/base: each copy and its original.
COPIES = {
    "config/policy.json": "deploy/gateway/policy.json",
    "config/intents.json": "deploy/gateway/intents.json",
    "config/tenants.json": "deploy/gateway/tenants.json",
    "config/intent_classes.toml": "deploy/engine/intent_classes.toml",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {"type": "object", "required": ["name"]},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {"metadata": _STRING_MAP},
                        },
                    },
                },
            }
        },
    },
    "PodMonitor": {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"]},
        },
    },
    "PrometheusRule": {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "rules": {"type": "array", "items": {"type": "object", "required": ["expr"]}}
                            },
                        },
                    }
                },
            }
        },
    },
}


def kustomize_command() -> list[str] | None:
    """`kustomize build` or `kubectl kustomize`, whichever is installed."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects one overlay renders to."""
    command = kustomize_command()
    if command is None:
        skip_unless_ci("neither kustomize nor kubectl is on PATH: install kubectl (it carries kustomize)")
    result = subprocess.run(
        [*command, str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kustomize failed on {overlay}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(obj: dict[str, Any]) -> None:
    """Raises when the object breaks its kind's schema."""
    schema = CRD_SCHEMAS.get(obj["kind"])
    if schema is not None:
        jsonschema.validate(obj, schema)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of that kind and name."""
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def container(workload: dict[str, Any]) -> dict[str, Any]:
    """A workload's first container."""
    return workload["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    """A workload's first container's environment."""
    return {e["name"]: e.get("value", "") for e in container(workload).get("env", [])}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_every_rendered_object_is_valid(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    failures = []
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as error:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message}")
    assert not failures, f"overlay {overlay}:\n" + "\n".join(failures)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"thermocline"}


def test_the_validator_rejects_a_misspelt_field() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "x", "imagee": "x"}]}}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_each_service_is_there_with_its_shape(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for kind, name in [*SERVICES, ("Deployment", "redis"), ("Deployment", "otel-collector")]:
        find(objects, kind, name)
    kvstore = find(objects, "StatefulSet", "kvstore")
    assert kvstore["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "segments"
    gateway_ports = {p["name"]: p["port"] for p in find(objects, "Service", "gateway")["spec"]["ports"]}
    assert gateway_ports == {"grpc": 50051, "http": 8080}
    assert env_of(find(objects, "Deployment", "gateway"))["THERMOCLINE_GATEWAY_HTTP_PORT"] == "8080"


def test_every_service_holds_the_service_token(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The file THERMOCLINE_SERVICE_TOKEN_FILE names lies in the service-token Secret's mount."""
    _, objects = rendered
    for kind, name in SERVICES:
        workload = find(objects, kind, name)
        token_file = Path(env_of(workload)["THERMOCLINE_SERVICE_TOKEN_FILE"])
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        mounts = [m for m in container(workload)["volumeMounts"] if Path(m["mountPath"]) == token_file.parent]
        assert len(mounts) == 1 and mounts[0]["readOnly"], f"{name}: {token_file} is not mounted read-only"
        assert volumes[mounts[0]["name"]]["secret"]["secretName"] == "service-token", name


def test_engine_drains_within_its_grace_period(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for kind, name in [("StatefulSet", "engine"), ("Deployment", "gateway"), ("StatefulSet", "kvstore")]:
        workload = find(objects, kind, name)
        pre_stop_s = int(container(workload)["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain_s = float(env_of(workload)[f"THERMOCLINE_{name.upper()}_GRACE_S"])
        grace_s = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s > pre_stop_s + drain_s, f"{name}: SIGKILL would cut the drain short"
    engine = container(find(objects, "StatefulSet", "engine"))
    assert engine["readinessProbe"]["grpc"]["port"] == 50052


def test_a_refusing_engine_is_live_and_reachable_but_not_ready(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Readiness reads the engine service's health name (NOT_SERVING while its gate refuses every
    Generate), startup and liveness the server's "" (a restart reloads the same gate); the headless
    Service keeps a not-ready replica's DNS name, so when every replica refuses, the gateway still
    reaches one and the caller gets its FAILED_PRECONDITION rather than UNAVAILABLE."""
    _, objects = rendered
    engine = container(find(objects, "StatefulSet", "engine"))
    service_name = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
    assert engine["readinessProbe"]["grpc"] == {"port": 50052, "service": service_name}
    for probe in ("startupProbe", "livenessProbe"):
        assert engine[probe]["grpc"].get("service", "") == "", f"{probe} must read the server's health"
    headless = find(objects, "Service", "engine")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert find(objects, "StatefulSet", "engine")["spec"]["serviceName"] == "engine"


def test_the_safety_service_names_every_ready_replica(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The gateway sends checks to the addresses of its safety target in turn: headless, `safety`
    resolves to each ready replica; a ClusterIP would give it one address, so one replica."""
    _, objects = rendered
    spec = find(objects, "Service", "safety")["spec"]
    assert spec["clusterIP"] == "None" and not spec.get("publishNotReadyAddresses", False)
    gateway = env_of(find(objects, "Deployment", "gateway"))
    assert gateway["THERMOCLINE_GATEWAY_SAFETY_TARGET"] == "safety:50053"


def test_the_gpu_overlay_asks_for_gpus_and_scales_on_golden_metrics() -> None:
    objects = render("gpu")
    engine = find(objects, "StatefulSet", "engine")
    assert container(engine)["resources"]["limits"]["nvidia.com/gpu"] == 1
    scaled = find(objects, "ScaledObject", "engine")
    queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
    assert "thermocline_engine_queue_wait_seconds_bucket" in queries
    assert "thermocline_engine_time_to_first_token_seconds_bucket" in queries
    gateway = find(objects, "ScaledObject", "gateway")
    gateway_load = " ".join(t["metadata"]["query"] for t in gateway["spec"]["triggers"])
    for counter in ("thermocline_rpc_server_handled_total", "thermocline_gateway_http_requests_total"):
        assert counter in gateway_load, f"the gateway scales on both fronts' load: {counter} is missing"
    all_scalers = [t["type"] for o in objects if o["kind"] == "ScaledObject" for t in o["spec"]["triggers"]]
    assert set(all_scalers) == {"prometheus"}, "autoscaling follows Prometheus metrics, not CPU"
    targets = env_of(find(objects, "Deployment", "gateway"))["THERMOCLINE_GATEWAY_ENGINE_TARGETS"].split(",")
    assert targets == [f"engine-{n}.engine:50052" for n in range(scaled["spec"]["maxReplicaCount"])]


def test_the_gpu_overlay_carries_the_alert_rules() -> None:
    rule = find(render("gpu"), "PrometheusRule", "thermocline-alerts")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"], "regenerate overlays/gpu/monitoring.yaml"


def test_the_laptop_overlay_runs_on_the_cpu() -> None:
    objects = render("laptop")
    assert env_of(find(objects, "StatefulSet", "engine"))["THERMOCLINE_ENGINE_DEVICE"] == "cpu"
    hpa = find(objects, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "gateway"
    assert not any("nvidia.com/gpu" in json.dumps(o) for o in objects)


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_config_copies_match_their_originals(copy: str) -> None:
    original = ROOT / COPIES[copy]
    assert (K8S / "base" / copy).read_text() == original.read_text(), (
        f"cp {COPIES[copy]} deploy/k8s/base/{copy}"
    )


@pytest.mark.parametrize("folder", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_every_kustomization_reference_resolves(folder: str) -> None:
    kustomization = yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())
    paths = list(kustomization.get("resources", []))
    paths += [p["path"] for p in kustomization.get("patches", []) if "path" in p]
    paths += [
        re.sub(r"^[^=]+=", "", f) for g in kustomization.get("configMapGenerator", []) for f in g["files"]
    ]
    missing = [p for p in paths if not (K8S / folder / p).exists()]
    assert not missing, f"{folder}/kustomization.yaml names files that do not exist: {missing}"
