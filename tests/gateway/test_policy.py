"""RBAC, intents and the audit log through a real gateway with operator policy files."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import call_metadata
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit import prompt_sha256
from services.gateway.audit_chain import segment_paths
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import call, client_request_id, refusal, send, token, write_policy_files
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc

STINGY_BURST = 3


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("policy-mesh")
    # "stingy" refills one request every ~17 minutes: within a test, it gets STINGY_BURST calls
    tenants = {"tenants": {"stingy": {"requests_per_s": 0.001, "burst_requests": STINGY_BURST}}}
    started = start_mesh(stories_model, state, collector, **write_policy_files(state / "policy", tenants))
    yield started
    started.stop()


def _decisions(mesh: Mesh) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in segment_paths(mesh.audit_dir, "decisions")
        for line in path.read_text().splitlines()
    ]


def test_deny_by_default_names_the_missing_permission(mesh: Mesh) -> None:
    no_roles = token(mesh, subject="nobody")
    error = refusal(mesh.target("gateway"), no_roles, intent="chat")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "permission 'invoke' on the default model" in error.details()
    assert "roles [none]" in error.details()
    assert "on model '" not in error.details()  # the served model is not named to it


def test_a_reader_may_list_but_not_invoke(mesh: Mesh) -> None:
    reader = token(mesh, subject="reader", roles=["reader"])
    error = refusal(mesh.target("gateway"), reader, intent="chat")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'invoke'" in error.details() and "roles [reader]" in error.details()
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        reply = stub.ListModels(pb.ListModelsRequest(), metadata=call_metadata(reader), timeout=10)
        assert len(reply.models) == 1
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListModels(pb.ListModelsRequest(), metadata=call_metadata(token(mesh)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'list_models'" in caught.value.details()


def test_roles_inherit_and_claims_map_to_roles(mesh: Mesh) -> None:
    user = token(mesh, subject="user", roles=["user"])  # user inherits reader's list_models
    assert call(mesh.target("gateway"), user, intent="chat").done is not None
    admin_by_group = token(mesh, subject="ops", groups=["ml-platform"])  # admin ⊃ user ⊃ reader
    assert call(mesh.target("gateway"), admin_by_group, intent="chat").done is not None
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        assert stub.ListModels(pb.ListModelsRequest(), metadata=call_metadata(user), timeout=10).models


def test_intent_is_required_and_unknown_ones_are_listed(mesh: Mesh) -> None:
    user = token(mesh, subject="user", roles=["user"])
    missing = refusal(mesh.target("gateway"), user, intent=None)
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x-intent' is required" in missing.details()
    unknown = refusal(mesh.target("gateway"), user, intent="astrology")
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown intent 'astrology'; known intents: batch, chat, code-completion" in unknown.details()


def test_tenant_and_intent_map_to_the_priority_class_in_the_audit(mesh: Mesh) -> None:
    user = token(mesh, subject="classy", tenant="globex", roles=["user"])
    call(mesh.target("gateway"), user, intent="batch", extra_metadata=[("x-request-id", "class-check")])
    event = next(e for e in _decisions(mesh) if client_request_id(e) == "class-check")
    assert event["details"]["priority_class"] == "batch"  # type: ignore[index]
    assert event["tenant"] == "globex" and event["decision"] == "allow"


def test_the_callers_request_id_is_recorded_beside_the_gateways_own(mesh: Mesh) -> None:
    user = token(mesh, subject="stamper", tenant="stampers", roles=["user"])
    for intent in ("chat", "no-such-intent"):  # an allow and a deny, under one caller's id
        with contextlib.suppress(grpc.RpcError):
            call(
                mesh.target("gateway"),
                user,
                intent=intent,
                extra_metadata=[("x-request-id", "someone-elses")],
            )
    events = [e for e in _decisions(mesh) if client_request_id(e) == "someone-elses"]
    assert [e["decision"] for e in events] == ["allow", "deny"]
    own_ids = [str(e["request_id"]) for e in events]
    assert len(set(own_ids)) == 2 and all(re.fullmatch("[0-9a-f]{32}", i) for i in own_ids), own_ids
    assert not [e for e in _decisions(mesh) if e["request_id"] == "someone-elses"]


def _metadata(bearer: str, request_id: str, intent: str = "chat") -> list[tuple[str, str]]:
    return [*call_metadata(bearer, intent), ("x-request-id", request_id)]


def test_a_huge_model_name_is_refused_by_size_and_its_audit_record_stays_small(mesh: Mesh) -> None:
    no_roles = token(mesh, subject="filler")
    request = pb.GenerateRequest(model="m" * 100_000, prompt=STORIES_PROMPT)
    error = send(mesh.target("gateway"), request, _metadata(no_roles, "huge-model"))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model name is 100000 characters; at most 128 are allowed" in error.details()
    lines = [
        line
        for path in segment_paths(mesh.audit_dir, "decisions")
        for line in path.read_text().splitlines()
        if '"client_request_id":"huge-model"' in line
    ]
    assert len(lines) == 1 and len(lines[0]) < 4096, [len(line) for line in lines]


def test_a_caller_without_a_role_learns_nothing_about_served_models(mesh: Mesh) -> None:
    request = pb.GenerateRequest(model="secret-model", prompt=STORIES_PROMPT)
    no_roles = send(mesh.target("gateway"), request, _metadata(token(mesh, subject="nobody"), "probe"))
    assert no_roles is not None and no_roles.code() == grpc.StatusCode.PERMISSION_DENIED
    user = token(mesh, subject="user", roles=["user"])
    missing = send(mesh.target("gateway"), request, _metadata(user, "probe-2"))
    assert missing is not None and missing.code() == grpc.StatusCode.NOT_FOUND


def test_every_refusal_after_authentication_costs_the_tenant_budget(mesh: Mesh) -> None:
    stingy = token(mesh, subject="stingy-user", tenant="stingy", roles=["user"])
    bad_sampling = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingOptions(temperature=1e-40))
    for n in range(STINGY_BURST):  # three refusals of three kinds, each costing one request
        kinds = [("nobody-knows", bad_sampling), ("chat", bad_sampling), ("chat", pb.GenerateRequest())]
        intent, request = kinds[n]
        error = send(mesh.target("gateway"), request, _metadata(stingy, f"stingy-{n}", intent))
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    good = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingOptions(max_tokens=1))
    error = send(mesh.target("gateway"), good, _metadata(stingy, "stingy-good"))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit for tenant 'stingy' reached" in error.details()


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [
        (pb.SamplingOptions(temperature=1e-40), "temperature must be 0 (greedy) or in [0.001, 100]"),
        (pb.SamplingOptions(temperature=float("nan")), "temperature must be 0"),
        (pb.SamplingOptions(top_p=float("inf")), "top_p must be in (0, 1]"),
        (pb.SamplingOptions(top_k=1 << 30), "top_k must be at most 1048576"),
        (pb.SamplingOptions(stop=["x"] * 17), "17 stop strings sent; at most 16"),
        (pb.SamplingOptions(stop=["x" * 300]), "a stop string must be 1-256 characters, got 300"),
    ],
)
def test_sampling_values_outside_their_range_are_refused(
    mesh: Mesh, sampling: pb.SamplingOptions, reason: str
) -> None:
    user = token(mesh, subject="sampler", tenant="samplers", roles=["user"])
    request = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=sampling)
    error = send(mesh.target("gateway"), request, _metadata(user, "sampling"))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.details()


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (
            pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingOptions(max_tokens=5000)),
            "max_tokens 5000 exceeds this engine's limit of 4096; ask for at most 4096",
        ),
        (
            pb.GenerateRequest(chat=pb.ChatTurns(messages=[pb.ChatMessage(role="user", content="hi")])),
            "has no chat template; send a plain prompt",
        ),
    ],
    ids=["max-tokens-over-the-engines-limit", "chat-without-a-template"],
)
def test_a_request_the_engine_would_refuse_is_refused_before_its_allow_event(
    mesh: Mesh, request_: pb.GenerateRequest, says: str
) -> None:
    """The engine's GetModelInfo says what it refuses; the gateway refuses it first, in the engine's
    words, so the call costs no allow event, no token reservation and no screen."""
    user = token(mesh, subject="eager", tenant="eager", roles=["user"])
    client_id = f"engine-would-refuse-{says[:9]}"
    error = send(mesh.target("gateway"), request_, _metadata(user, client_id))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert says in error.details() and not error.details().startswith("engine:")
    events = [e for e in _decisions(mesh) if client_request_id(e) == client_id]
    assert [(e["action"], e["decision"], e["reason"]) for e in events] == [
        ("invoke", "deny", error.details())
    ]


def test_an_oversized_prompt_is_refused_with_its_limit_before_it_is_tokenized(mesh: Mesh) -> None:
    user = token(mesh, subject="verbose", tenant="verbose", roles=["user"])
    over = pb.GenerateRequest(prompt="a" * (512 * 1024 + 1))
    error = send(mesh.target("gateway"), over, _metadata(user, "big-prompt"))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is 524289 bytes (UTF-8); this gateway accepts at most 524288" in error.details()
    # far beyond the limit, the gRPC server refuses the message before parsing it
    flood = pb.GenerateRequest(prompt="a" * (4 * 1024 * 1024))
    error = send(mesh.target("gateway"), flood, _metadata(user, "huge-prompt"))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()


def test_the_prompt_byte_limit_is_checked_before_the_token_and_the_refusal_is_audited(mesh: Mesh) -> None:
    over = pb.GenerateRequest(prompt="a" * (512 * 1024 + 1))
    error = send(mesh.target("gateway"), over, _metadata("not-a-jwt", "big-unauthenticated"))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "prompt is 524289 bytes (UTF-8); this gateway accepts at most 524288" in error.details()
    refused = [e for e in _decisions(mesh) if client_request_id(e) == "big-unauthenticated"]
    assert [(e["actor_principal"], e["decision"]) for e in refused] == [("unauthenticated", "deny")]


def test_oversized_metadata_and_two_credentials_are_refused(mesh: Mesh) -> None:
    user = token(mesh, subject="meta", tenant="meta", roles=["user"])
    request = pb.GenerateRequest(prompt=STORIES_PROMPT)
    long_intent = send(mesh.target("gateway"), request, _metadata(user, "meta", intent="c" * 1000))
    assert long_intent is not None and long_intent.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "metadata 'x-intent' is 1000 characters; at most 256" in long_intent.details()
    other = token(mesh, subject="someone-else", tenant="meta", roles=["user"])
    two = [*_metadata(user, "two-tokens"), ("authorization", f"Bearer {other}")]
    error = send(mesh.target("gateway"), request, two)
    assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "2 'authorization' metadata entries sent" in error.details()
    denied = [e for e in _decisions(mesh) if client_request_id(e) == "two-tokens"]
    assert [e["decision"] for e in denied] == ["deny"]


@pytest.mark.parametrize("key", ["x-intent", "x-retrieval-mode", "x-request-id"])
def test_a_metadata_entry_the_gateway_reads_sent_twice_is_refused(mesh: Mesh, key: str) -> None:
    user = token(mesh, subject="twice", tenant="twice", roles=["user"])
    values = {"x-intent": ("chat", "batch"), "x-retrieval-mode": ("off", "semantic")}.get(key, ("a", "b"))
    metadata = [*call_metadata(user), *((key, value) for value in values)]
    if key != "x-intent":
        metadata.append(("x-intent", "chat"))
    error = send(mesh.target("gateway"), pb.GenerateRequest(prompt=STORIES_PROMPT), metadata)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert f"2 '{key}' metadata entries sent; send it once" in error.details()


def test_sigkill_after_acknowledged_requests_loses_no_audit_event(mesh: Mesh) -> None:
    user = token(mesh, subject="durable", roles=["user"])
    secret_prompt = "Once upon a time the secret word was PLUGH"
    num_requests = 12
    for n in range(num_requests):
        request_id = [("x-request-id", f"kill-{n}")]
        if n % 3 == 0:  # every third one is denied: an unknown intent
            refusal(mesh.target("gateway"), user, intent="nope", extra_metadata=request_id)
        else:
            call(mesh.target("gateway"), user, intent="chat", prompt=secret_prompt, extra_metadata=request_id)
    mesh.processes["gateway"].send_signal(signal.SIGKILL)
    mesh.processes["gateway"].wait(30)

    events = {client_request_id(e): e for e in _decisions(mesh) if client_request_id(e).startswith("kill-")}
    assert sorted(events) == sorted(f"kill-{n}" for n in range(num_requests))
    assert [events[f"kill-{n}"]["decision"] for n in range(3)] == ["deny", "allow", "allow"]
    assert events["kill-1"]["prompt_sha256"] == prompt_sha256(secret_prompt)
    raw = "".join(p.read_text() for p in mesh.audit_dir.glob("*.jsonl"))
    assert "PLUGH" not in raw and user not in raw and user.split(".")[1] not in raw
    verify = [sys.executable, "-m", "services.cli.main", "audit", "verify", str(mesh.audit_dir)]
    verify += ["--key-file", str(mesh.audit_key_path)]  # the chain and its signed checkpoints
    done = subprocess.run(verify, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    mesh.start_service("gateway")  # a restarted gateway continues the same chain
    call(mesh.target("gateway"), user, intent="chat", prompt=STORIES_PROMPT)
    assert subprocess.run(verify, capture_output=True, timeout=60).returncode == 0
