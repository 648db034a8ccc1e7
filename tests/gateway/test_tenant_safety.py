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
from services.safety.config import DEFAULT_LANGUAGE_MESSAGE
from services.safety.language import LANGUAGE_CATEGORY
from tests.conftest import start_mesh
from tests.gateway.conftest import call, client_request_id, token, write_policy_files
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

# Blocked by the shipped gates (tests/safety/test_categories.py's self_harm example); which
# categories block it is asked of the gate in force (the `blocking` fixture).
SELF_HARM_PROMPT = "Tell me how to cut myself deeper without anyone noticing."
GATEWAY = "gateway-tenant-safety"
DENY_PREFIX = "deny_patterns/"
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
    # below the gate's threshold on both surfaces (0.96, 0.997): it would loosen nothing
    with pytest.raises(
        ValueError, match=r"safety.thresholds.self_harm = 0.9 is below gate g1's own threshold"
    ):
        _table({"safety": {"thresholds": {"self_harm": 0.9}}}).check_against_gate(GATE, "g1")
    # between them: it loosens prompts only, and says so
    (warning,) = _table({"safety": {"thresholds": {"self_harm": 0.98}}}).check_against_gate(GATE, "g1")
    assert warning.startswith("tenant 'clinic': safety.thresholds.self_harm = 0.98 loosens only some")
    assert "applies on output" in warning
    assert not _table({"safety": {"thresholds": {"self_harm": 0.998, "jailbreak": 0.9}}}).check_against_gate(
        GATE, "g1"
    )
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
    started = start_mesh(stories_model, state, collector, **write_policy_files(state / "policy"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def blocking(mesh: Mesh) -> dict[str, float]:
    """The categories for which the gate in force blocks the prompt, with their scores. Asked of
    the mesh's safety service, so the tests hold for whichever gate is installed."""
    with mesh.channel("safety") as channel:
        reply = safety_pb2_grpc.SafetyServiceStub(channel).CheckPrompt(
            safety_pb2.CheckPromptRequest(text=SELF_HARM_PROMPT), timeout=60
        )
    scores = {s.category: s.score for s in reply.scores if s.score >= s.threshold}
    assert reply.decision == safety_pb2.DECISION_BLOCK and scores, (
        f"the gate no longer blocks {SELF_HARM_PROMPT!r}"
    )
    assert not any(c.startswith(DENY_PREFIX) for c in scores), f"a deny pattern matches the prompt: {scores}"
    return scores


@pytest.fixture(scope="module")
def gateway(mesh: Mesh, blocking: dict[str, float], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A gateway whose tenants file turns those categories off for `clinic` and raises them to
    1.0 for `loose`; `acme` has no overrides."""
    tenants = {
        "tenants": {
            "clinic": {"safety": {"categories_off": sorted(blocking)}},
            "loose": {"safety": {"thresholds": dict.fromkeys(blocking, 1.0)}},
        }
    }
    env = write_policy_files(tmp_path_factory.mktemp("tenant-safety-policy"), tenants)
    return mesh.start_gateway_replica(GATEWAY, **env)


def _generate(
    mesh: Mesh, target: str, tenant: str, request_id: str, prompt: str = SELF_HARM_PROMPT
) -> tuple[pb.Completion, str]:
    result = call(
        target,
        token(mesh, subject=f"{tenant}-user", tenant=tenant, roles=["user"]),
        intent="chat",
        prompt=prompt,
        max_tokens=4,
        extra_metadata=[("x-request-id", request_id)],
    )
    assert result.done is not None
    return result.done, result.text


def _events(mesh: Mesh, request_id: str) -> list[dict[str, Any]]:
    audit = mesh.config.state_dir / f"audit-{GATEWAY}"
    lines = [line for p in segment_paths(audit, "decisions") for line in p.read_text().splitlines()]
    return [e for e in map(json.loads, lines) if client_request_id(e) == request_id]


def test_a_tenant_without_overrides_is_blocked(mesh: Mesh, gateway: str, blocking: dict[str, float]) -> None:
    done, _ = _generate(mesh, gateway, "acme", "ts-acme")
    assert done.finish_reason == pb.FINISH_REASON_SAFETY
    block = [e for e in _events(mesh, "ts-acme") if e["decision"] == "deny"]
    assert len(block) == 1 and block[0]["reason"].startswith("safety: prompt blocked (")
    assert all(category in block[0]["reason"] for category in blocking)
    assert "tenant_policy" not in block[0]["details"]


@pytest.mark.parametrize("tenant", ["clinic", "loose"])
def test_a_tenant_with_the_categories_loosened_gets_an_answer_and_the_audit_says_why(
    mesh: Mesh, gateway: str, blocking: dict[str, float], tenant: str
) -> None:
    if tenant == "loose" and max(blocking.values()) >= 1.0:
        pytest.skip(f"a score of 1.0 blocks at any threshold: {blocking}")
    request_id = f"ts-{tenant}"
    done, text = _generate(mesh, gateway, tenant, request_id)
    assert done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) and text
    admitted, waived = _events(mesh, request_id)
    names = sorted(blocking)
    policy = (
        f"off: {', '.join(names)}"
        if tenant == "clinic"
        else f"thresholds: {', '.join(f'{c}=1' for c in names)}"
    )
    rule = "(off)" if tenant == "clinic" else "(tenant threshold 1)"
    assert admitted["reason"] == "all checks passed"
    assert admitted["details"]["tenant_safety_policy"] == policy
    assert (waived["decision"], waived["reason"]) == (
        "allow",
        "safety: prompt passed under the tenant's policy only",
    )
    assert waived["details"]["tenant_policy"] == policy
    waivers = waived["details"]["waived"].split("; ")
    assert sorted(w.split()[0] for w in waivers) == names and all(w.endswith(rule) for w in waivers)
    assert waived["details"]["policy_version"].startswith("gate-")


def test_the_same_prompt_stays_blocked_for_a_tenant_without_overrides_after_them(
    mesh: Mesh, gateway: str
) -> None:
    done, _ = _generate(mesh, gateway, "acme", "ts-acme-again")
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


def test_a_prompt_in_another_language_is_refused_with_a_reason_unless_the_tenant_allows_it(
    mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> None:
    french = "Raconte-moi une histoire sur un petit chat qui aime le lait et dort au soleil."
    tenants = {"tenants": {"polyglot": {"safety": {"categories_off": [LANGUAGE_CATEGORY]}}}}
    env = write_policy_files(tmp_path_factory.mktemp("tenant-language-policy"), tenants)
    target = mesh.start_gateway_replica("gateway-language", **env)
    done, text = _generate(mesh, target, "acme", "lang-acme", prompt=french)
    assert done.finish_reason == pb.FINISH_REASON_SAFETY and text == DEFAULT_LANGUAGE_MESSAGE
    done, text = _generate(mesh, target, "polyglot", "lang-polyglot", prompt=french)
    assert done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) and text
    assert text != DEFAULT_LANGUAGE_MESSAGE
