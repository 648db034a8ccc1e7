"""The example policy files in deploy/gateway load, and bad policies are refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from services.gateway.admission import TenantStreams
from services.gateway.intents import IntentPolicy
from services.gateway.jwks import KeySet
from services.gateway.rbac import Policy
from services.gateway.tenants import TenantTable, is_valid_tenant

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "gateway"


def test_the_example_files_load() -> None:
    policy = Policy.load(DEPLOY / "policy.json")
    assert policy.roles_of({"sub": "x", "groups": ["ml-platform"]}) == ["admin", "user", "reader", "auditor"]
    assert IntentPolicy.load(DEPLOY / "intents.json").default_intent == "default"
    tenants = TenantTable.load(DEPLOY / "tenants.json")
    assert tenants.limits("acme").on_redis_down == "open"
    assert tenants.limits("nobody").on_redis_down == "closed"
    assert KeySet(DEPLOY / "jwks.example.json", "RS256").kids


def test_inheritance_cycles_and_unknown_roles_or_operations_are_refused() -> None:
    with pytest.raises(ValueError, match="cycle"):
        Policy.from_dict({"roles": {"a": {"inherits": ["b"]}, "b": {"inherits": ["a"]}}})
    with pytest.raises(ValueError, match="undefined role"):
        Policy.from_dict({"roles": {"a": {"inherits": ["ghost"]}}})
    with pytest.raises(ValueError, match="unknown operation"):
        Policy.from_dict({"roles": {"a": {"grants": {"*": ["delete_everything"]}}}})


def test_model_patterns_scope_a_grant() -> None:
    policy = Policy.from_dict({"roles": {"med": {"grants": {"medical-*": ["invoke"]}}}})
    policy.authorize("doc", ["med"], "invoke", "medical-7b")
    with pytest.raises(PermissionDenied, match="permission 'invoke' on model 'llama-7b' is missing"):
        policy.authorize("doc", ["med"], "invoke", "llama-7b")


def test_a_wildcard_binding_needs_the_claim_to_be_present() -> None:
    policy = Policy.from_dict(
        {
            "roles": {"user": {"grants": {"*": ["invoke"]}}},
            "bindings": [{"claim": "groups", "value": "*", "roles": ["user"]}],
        }
    )
    assert policy.roles_of({"sub": "x", "groups": "eng"}) == ["user"]
    assert policy.roles_of({"sub": "x"}) == []
    with pytest.raises(PermissionDenied, match=r"holds roles \[none\]"):
        policy.authorize("x", policy.roles_of({"sub": "x"}), "invoke", "any-model")


def test_tenant_overrides_the_intent_class() -> None:
    document = {"default_intent": "chat", "intents": {"chat": {"priority_class": "std"}}}
    intents = IntentPolicy.from_dict(document)
    assert intents.priority_class(intents.resolve(None), {}) == "std"
    assert intents.priority_class("chat", {"chat": "gold"}) == "gold"
    with pytest.raises(InvalidArgument, match="known intents: chat"):
        intents.resolve("x" * 500)


def test_an_intent_limited_to_roles_is_refused_to_other_callers_by_name() -> None:
    intents = IntentPolicy.from_dict(
        {
            "default_intent": "default",
            "intents": {
                "default": {"priority_class": "standard"},
                "triage": {"priority_class": "critical", "roles": ["clinician", "nurse"]},
            },
        }
    )
    assert intents.resolve("triage", ["user", "nurse"]) == "triage"
    assert intents.resolve(None, []) == "default"
    refusal = "intent 'triage' may be declared only by callers with role clinician or nurse"
    with pytest.raises(PermissionDenied, match=refusal):
        intents.resolve("triage", ["user"])
    with pytest.raises(ValueError, match="'roles' must be a non-empty list"):
        IntentPolicy.from_dict({"default_intent": None, "intents": {"a": {"roles": "clinician"}}})
    with pytest.raises(ValueError, match="may not be limited to roles"):
        IntentPolicy.from_dict({"default_intent": "a", "intents": {"a": {"roles": ["x"]}}})


def test_bad_tenant_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="on_redis_down"):
        TenantTable.from_dict({"tenants": {"a": {"on_redis_down": "maybe"}}})
    with pytest.raises(ValueError, match="unknown tenant setting"):
        TenantTable.from_dict({"defaults": {"requests_per_minute": 5}})
    with pytest.raises(ValueError, match=r"tenant 'a': max_streams must be >= 0"):
        TenantTable.from_dict({"tenants": {"a": {"max_streams": -1}}})
    for reserved in ("default", "thermocline-warm-up"):  # the engine's own cache salts
        with pytest.raises(ValueError, match=f"tenants \\['{reserved}'\\] are names the services keep"):
            TenantTable.from_dict({"tenants": {reserved: {}, "acme": {}}})


def test_a_tenant_stream_cap_counts_each_tenant_alone_and_gives_slots_back() -> None:
    streams = TenantStreams(pushback_ms=250)
    streams.take("a", 2)
    streams.take("a", 2)
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 2 streams in flight") as refused:
        streams.take("a", 2)
    assert dict(refused.value.trailing_metadata)["retry-after-ms"] == "250"
    streams.take("b", 2)  # another tenant's slots are its own
    streams.take("c", 0)  # no cap of its own
    streams.release("a")
    streams.take("a", 2)
    assert (streams.num_in_flight("a"), streams.num_in_flight("b")) == (2, 1)


def test_a_tenant_without_its_own_max_streams_is_capped_at_the_default_of_64() -> None:
    """One tenant cannot take every one of the gateway's 256 slots unless its entry says so (0)."""
    unset = TenantTable.from_dict(
        {"defaults": {"requests_per_s": 5}, "tenants": {"acme": {"burst_requests": 9}}}
    )
    for table in (TenantTable(), unset, TenantTable.load(DEPLOY / "tenants.json")):  # no file; files
        streams = TenantStreams(pushback_ms=250)
        for tenant in ("nobody", "acme"):  # no entry; an entry that sets other limits only
            cap = table.limits(tenant).max_streams
            for _ in range(64):
                streams.take(tenant, cap)
            with pytest.raises(ResourceExhausted, match=f"tenant '{tenant}' has 64 streams in flight"):
                streams.take(tenant, cap)
    lifted = TenantTable.from_dict(
        {"defaults": {"max_streams": 0}, "tenants": {"a": {}, "b": {"max_streams": 2}}}
    )
    assert (lifted.limits("a").max_streams, lifted.limits("b").max_streams) == (0, 2)


@pytest.mark.parametrize("tenant", ["acme\n", "", "-acme", "a" * 129, "acme/../x", "acme corp"])
def test_tenant_ids_must_match_the_pattern_to_their_last_character(tenant: str) -> None:
    assert not is_valid_tenant(tenant)
    assert is_valid_tenant("acme.eu-1@prod")
