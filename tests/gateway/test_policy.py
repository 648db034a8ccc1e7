"""RBAC, intents and the audit log through a real gateway with operator policy files."""

from __future__ import annotations

import json
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
from tests.gateway.conftest import call, refusal, token, write_policy_files
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("policy-mesh")
    started = start_mesh(stories_model, state, collector, **write_policy_files(state / "policy"))
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
    assert "permission 'invoke' on model" in error.details() and "roles [none]" in error.details()


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
    event = next(e for e in _decisions(mesh) if e["request_id"] == "class-check")
    assert event["details"]["priority_class"] == "batch"  # type: ignore[index]
    assert event["tenant"] == "globex" and event["decision"] == "allow"


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

    events = {e["request_id"]: e for e in _decisions(mesh) if str(e["request_id"]).startswith("kill-")}
    assert sorted(events) == sorted(f"kill-{n}" for n in range(num_requests))
    assert [events[f"kill-{n}"]["decision"] for n in range(3)] == ["deny", "allow", "allow"]
    assert events["kill-1"]["prompt_sha256"] == prompt_sha256(secret_prompt)
    raw = "".join(p.read_text() for p in mesh.audit_dir.glob("*.jsonl"))
    assert "PLUGH" not in raw and user not in raw and user.split(".")[1] not in raw
    verify = [sys.executable, "-m", "services.cli.main", "audit", "verify", str(mesh.audit_dir)]
    done = subprocess.run(verify, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    mesh.start_service("gateway")  # a restarted gateway continues the same chain
    call(mesh.target("gateway"), user, intent="chat", prompt=STORIES_PROMPT)
    assert subprocess.run(verify, capture_output=True, timeout=60).returncode == 0
