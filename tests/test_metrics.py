"""Each service's /metrics through the real mesh: it parses as Prometheus text, carries the names and
types docs/metrics.md documents, follows the naming rules, and its counters move with traffic."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.gateway.tokens import mint_token
from thermocline.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SECTIONS = {
    "Every service": "all",
    "Gateway": "gateway",
    "Engine": "engine",
    "Safety": "safety",
    "KVStore": "kvstore",
}
SERVICES = ("gateway", "engine", "safety", "kvstore")
TENANT = "acme-metrics"
UNIT_SUFFIXES = (
    "_seconds",
    "_bytes",
    "_ratio",
    "_tokens",
    "_sequences",
    "_requests",
    "_objects",
    "_info",
    "_total",
)
STATE_GAUGES = {"thermocline_server_draining", "thermocline_engine_safety_gate_status"}  # 0/1 flags

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def documented() -> dict[str, dict[str, str]]:
    """service -> {family name -> type} from docs/metrics.md, conditional rows left out."""
    rows: dict[str, dict[str, str]] = {s: {} for s in SERVICES}
    section = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = SECTIONS.get(line[3:].strip())
        match = re.match(r"\| `(thermocline_\w+)` \| (\w+) \|.*\|(.*)\|$", line)
        if section is None or match is None or "*conditional*" in match.group(3):
            continue
        name, kind = match.group(1), match.group(2)
        family = name.removesuffix("_total") if kind == "counter" else name
        for service in SERVICES if section == "all" else (section,):
            rows[service][family] = kind
    return rows


def scrape(mesh: Mesh, service: str) -> tuple[dict[str, str], Samples]:
    """({family: type}, {(sample name, labels): value}) of one service's /metrics."""
    url = f"http://127.0.0.1:{mesh.config.ports.metrics[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of a sample over every label set that includes `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample, pairs), value in samples.items() if sample == name and wanted <= set(pairs))


@pytest.fixture(scope="module")
def traffic(stories_mesh: Mesh) -> dict[str, tuple[Samples, Samples]]:
    """Each service's samples before and after one gateway request and one kvstore call."""
    before = {s: scrape(stories_mesh, s)[1] for s in SERVICES}
    token = mint_token(stories_mesh.private_key_path.read_bytes(), subject="metrics", tenant=TENANT)
    with grpc.insecure_channel(stories_mesh.target("gateway")) as channel:
        request = build_request("Once upon a time", max_tokens=6)
        result = collect(stream_generate(channel, request, call_metadata(token), timeout_s=120))
    assert result.done is not None
    with (
        stories_mesh.channel("kvstore") as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        kvstore_pb2_grpc.KVStoreServiceStub(channel).Lookup(kvstore_pb2.LookupRequest(block_hashes=["ab"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value  # no namespace
    root = stories_mesh.http_url().removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=10) as response:  # the HTTP front
        assert response.status == 200
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(f"{root}/v1/embeddings", timeout=10)
    assert unknown.value.code == 404
    after = {s: scrape(stories_mesh, s)[1] for s in SERVICES}
    return {s: (before[s], after[s]) for s in SERVICES}


@pytest.mark.parametrize("service", SERVICES)
def test_metrics_carry_the_documented_names_and_types(
    stories_mesh: Mesh, traffic: dict[str, tuple[Samples, Samples]], service: str
) -> None:
    types, _ = scrape(stories_mesh, service)
    expected = documented()[service]
    assert expected, f"docs/metrics.md documents nothing for {service}"
    wrong = {name: (kind, types.get(name)) for name, kind in expected.items() if types.get(name) != kind}
    assert not wrong, f"{service}: documented (type, exported type) differ: {wrong}"


@pytest.mark.parametrize("service", SERVICES)
def test_names_carry_units_and_labels_never_carry_tenants(
    stories_mesh: Mesh, traffic: dict[str, tuple[Samples, Samples]], service: str
) -> None:
    types, samples = scrape(stories_mesh, service)
    ours = {name: kind for name, kind in types.items() if name.startswith("thermocline_")}
    unitless = [
        n for n in ours if n not in STATE_GAUGES and ours[n] != "counter" and not n.endswith(UNIT_SUFFIXES)
    ]
    assert not unitless, f"{service}: names without a unit suffix: {unitless}"
    for (name, labels), _ in samples.items():
        if ours.get(name.removesuffix("_total")) == "counter":
            assert name.endswith("_total"), name
        assert all("tenant" not in key and TENANT not in value for key, value in labels), (name, labels)


def test_counters_move_when_traffic_flows(traffic: dict[str, tuple[Samples, Samples]]) -> None:
    moved = {
        "gateway": (
            "thermocline_rpc_server_handled_total",
            {"method": "/thermocline.gateway.v1.GatewayService/Generate"},
        ),
        "engine": ("thermocline_engine_requests_total", {"finish_reason": "length"}),
        "safety": ("thermocline_safety_checks_total", {"layer": "prompt"}),
        "kvstore": ("thermocline_rpc_server_handled_total", {"code": "INVALID_ARGUMENT"}),
    }
    for service, (name, labels) in moved.items():
        before, after = traffic[service]
        assert total(after, name, **labels) == total(before, name, **labels) + 1, (service, name)
    before, after = traffic["gateway"]
    http = "thermocline_gateway_http_requests_total"
    for route, code in (("/health", "200"), ("other", "404")):  # an unserved path is "other"
        assert total(after, http, route=route, code=code) == total(before, http, route=route, code=code) + 1
    assert total(after, "thermocline_gateway_audit_unwritable_seconds") == 0  # the audit log wrote
    failures = "thermocline_gateway_audit_write_failures_total"
    assert total(after, failures) == total(before, failures)
    before, after = traffic["engine"]
    for name in (
        "thermocline_engine_time_to_first_token_seconds_count",
        "thermocline_engine_time_per_output_token_seconds_count",
        "thermocline_engine_request_latency_seconds_count",
        "thermocline_engine_queue_wait_seconds_count",
    ):
        assert total(after, name) == total(before, name) + 1, name
    generated = "thermocline_engine_generated_tokens_total"
    assert total(after, generated) == total(before, generated) + 6
    assert total(after, "thermocline_engine_batch_sequences_count") > total(
        before, "thermocline_engine_batch_sequences_count"
    )


@pytest.mark.parametrize("service", SERVICES)
def test_garbage_collections_are_timed_by_generation(
    stories_mesh: Mesh, traffic: dict[str, tuple[Samples, Samples]], service: str
) -> None:
    _, after = traffic[service]
    young = total(after, "thermocline_gc_pause_seconds_count", generation="0")
    assert young > 0, f"{service}: no young collection timed since start-up"
    assert total(after, "thermocline_gc_pause_seconds_sum", generation="0") > 0


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_froze_what_its_start_up_built(
    stories_mesh: Mesh, traffic: dict[str, tuple[Samples, Samples]], service: str
) -> None:
    _, after = traffic[service]
    # grpc, protobuf and OpenTelemetry alone leave tens of thousands of tracked objects
    assert total(after, "thermocline_gc_frozen_objects") > 10_000, service
