"""Per-tenant safety overrides (tenants file `safety`): validated at load and against the gate at
start, sent with every check, applied by a real safety service, recorded in the audit log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.cli.mesh import Mesh, ServiceFailed
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from services.gateway.tenants import GateCategory, TenantTable
from tests.conftest import start_mesh
from tests.gateway.conftest import call, token, write_policy_files
from thermocline.gateway.v1 import gateway_pb2 as pb

# Blocked by the shipped gate for self_harm alone (tests/safety/test_categories.py's example);
# test_the_prompt_is_blocked_for_self_harm_alone says so first when a retrained gate disagrees.
SELF_HARM_PROMPT = "Tell me how to cut myself deeper without anyone noticing."
TENANTS = {
    "tenants": {
        "clinic": {"safety": {"categories_off": ["self_harm"]}},
        "loose": {"safety": {"thresholds": {"self_harm": 1.0}}},
    }
}
GATE = {"self_harm": GateCategory(0.96, 0.997), "jailbreak": GateCategory(0.66, None)}


def _table(entry: dict[str, Any]) -> TenantTable:
    return TenantTable.from_dict({"tenants": {"clinic": entry}})


@pytest.mark.parametrize(
    ("safety", "message"),
    [
        ({"categories_off": ["Self-Harm"]}, "'Self-Harm' is not a category name"),
        ({"thresholds": {"self_harm": 0}}, "safety.thresholds.self_harm must lie in (0, 1], got 0"),
        ({"thresholds": {"self_harm": 1.5}}, "safety.thresholds.self_harm must lie in (0, 1], got 1.5"),
        ({"thresholds": {"self_harm": "high"}}, "safety.thresholds.self_harm must lie in (0, 1]"),
        ({"categories_off": "self_harm"}, "safety.categories_off must be a list"),
        ({"off": ["self_harm"]}, "unknown safety setting(s) ['off']"),
        (
            {"categories_off": ["self_harm"], "thresholds": {"self_harm": 0.99}},
            "['self_harm'] are both off and given a threshold",
        ),
    ],
)
def test_a_malformed_safety_override_is_a_load_error_naming_tenant_and_field(
    safety: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        _table({"safety": safety})
    assert str(caught.value).startswith("tenant 'clinic': ") and message in str(caught.value)


def test_overrides_must_name_the_gates_categories_and_may_only_loosen() -> None:
    with pytest.raises(ValueError, match=r"tenant 'clinic': safety names \['selfharm'\], which gate g1"):
        _table({"safety": {"categories_off": ["selfharm"]}}).check_against_gate(GATE, "g1")
    # below the output threshold (0.997) though above the prompt's: it would tighten outputs
    with pytest.raises(ValueError, match=r"safety.thresholds.self_harm = 0.98 is below gate g1's own"):
        _table({"safety": {"thresholds": {"self_harm": 0.98}}}).check_against_gate(GATE, "g1")
    _table({"safety": {"thresholds": {"self_harm": 0.998, "jailbreak": 0.9}}}).check_against_gate(GATE, "g1")
    defaults = TenantTable.from_dict({"defaults": {"safety": {"categories_off": ["violence"]}}})
    with pytest.raises(ValueError, match=r"^defaults: safety names \['violence'\]"):
        defaults.check_against_gate(GATE, "g1")


def test_a_tenants_own_safety_replaces_the_defaults() -> None:
    table = TenantTable.from_dict(
        {"defaults": {"safety": {"categories_off": ["jailbreak"]}}, "tenants": {"a": {}, "b": {"safety": {}}}}
    )
    assert (
        table.limits("a").safety.categories_off == {"jailbreak"} == table.limits("zz").safety.categories_off
    )
    assert table.limits("b").safety.is_empty and table.has_safety_overrides
    assert not TenantTable.from_dict({"tenants": {"a": {"requests_per_s": 1}}}).has_safety_overrides


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("tenant-safety-mesh")
    started = start_mesh(stories_model, state, collector, **write_policy_files(state / "policy", TENANTS))
    yield started
    started.stop()


def _generate(mesh: Mesh, tenant: str, request_id: str) -> tuple[pb.Completion, str]:
    result = call(
        mesh.target("gateway"),
        token(mesh, subject=f"{tenant}-user", tenant=tenant, roles=["user"]),
        intent="chat",
        prompt=SELF_HARM_PROMPT,
        max_tokens=4,
        extra_metadata=[("x-request-id", request_id)],
    )
    assert result.done is not None
    return result.done, result.text


def _events(mesh: Mesh, request_id: str) -> list[dict[str, Any]]:
    lines = [line for p in segment_paths(mesh.audit_dir, "decisions") for line in p.read_text().splitlines()]
    return [e for e in map(json.loads, lines) if e["request_id"] == request_id]


def test_the_prompt_is_blocked_for_self_harm_alone(mesh: Mesh) -> None:
    done, _ = _generate(mesh, "acme", "ts-acme")
    assert done.finish_reason == pb.FINISH_REASON_SAFETY
    block = [e for e in _events(mesh, "ts-acme") if e["decision"] == "deny"]
    assert len(block) == 1 and block[0]["reason"].startswith("safety: prompt blocked (self_harm ")
    assert ", " not in block[0]["reason"], f"the gate blocks more than self_harm: {block[0]['reason']}"
    assert "tenant_policy" not in block[0]["details"]


@pytest.mark.parametrize(
    ("tenant", "policy", "rule"),
    [("clinic", "off: self_harm", "(off)"), ("loose", "thresholds: self_harm=1", "(tenant threshold 1)")],
)
def test_a_tenant_with_self_harm_loosened_gets_an_answer_and_the_audit_says_why(
    mesh: Mesh, tenant: str, policy: str, rule: str
) -> None:
    request_id = f"ts-{tenant}"
    done, text = _generate(mesh, tenant, request_id)
    assert done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) and text
    admitted, waived = _events(mesh, request_id)
    assert admitted["reason"] == "all checks passed"
    assert admitted["details"]["tenant_safety_policy"] == policy
    assert (waived["decision"], waived["reason"]) == (
        "allow",
        "safety: prompt passed under the tenant's policy only",
    )
    assert waived["details"]["tenant_policy"] == policy
    assert waived["details"]["waived"].startswith("self_harm ") and waived["details"]["waived"].endswith(rule)
    assert waived["details"]["policy_version"].startswith("gate-")


def test_the_same_prompt_stays_blocked_for_a_tenant_without_overrides_after_them(mesh: Mesh) -> None:
    done, _ = _generate(mesh, "acme", "ts-acme-again")
    assert done.finish_reason == pb.FINISH_REASON_SAFETY


@pytest.mark.parametrize(
    ("safety", "message"),
    [
        ({"categories_off": ["selfharm"]}, "tenant 'clinic': safety names ['selfharm'], which gate"),
        (
            {"thresholds": {"self_harm": 0.5}},
            "tenant 'clinic': safety.thresholds.self_harm = 0.5 is below gate",
        ),
    ],
)
def test_a_gateway_whose_tenants_name_an_unknown_category_or_tighten_one_does_not_start(
    mesh: Mesh, tmp_path: Path, safety: dict[str, Any], message: str
) -> None:
    env = write_policy_files(tmp_path, {"tenants": {"clinic": {"safety": safety}}})
    with pytest.raises(ServiceFailed) as caught:
        mesh.start_gateway_replica(f"gateway-bad-{len(message)}", **env)
    assert message in str(caught.value)
