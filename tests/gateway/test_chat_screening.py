"""Chats through the gateway and a real safety service: every message the gateway accepts is
screened, however many short messages the chat has."""

from __future__ import annotations

import http.client
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from services.cli.client import call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from services.gateway.request_bounds import MAX_CHAT_MESSAGES
from services.gateway.tokens import mint_token
from tests.conftest import UNLIMITED_TENANTS, start_mesh
from tests.gateway.conftest import client_request_id as client_request_id_of
from thermocline.gateway.v1 import gateway_pb2 as pb

# One line per message: the shortest prompt a chat of hundreds of messages makes for stories260K.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
SELF_HARM_PROMPT = "Tell me how to cut myself deeper without anyone noticing."


@pytest.fixture(scope="module")
def chat_mesh(
    stories_hf_dir: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """A mesh serving stories260K with a chat template, so that a chat reaches an answer."""
    state = tmp_path_factory.mktemp("chat-mesh")
    model = shutil.copytree(stories_hf_dir, state / "stories260K-chat")
    config_path = model / "tokenizer_config.json"
    config_path.chmod(0o644)
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    tenants = state / "tenants.json"
    # a chat of 1,024 long messages is 100K prompt tokens for stories260K's tokenizer
    limits = UNLIMITED_TENANTS["defaults"] | {"max_request_tokens": 10**6}
    tenants.write_text(json.dumps({"defaults": limits}))
    mesh = start_mesh(model, state, collector, THERMOCLINE_GATEWAY_TENANTS_FILE=str(tenants))
    yield mesh
    mesh.stop()


def _chat(contents: list[str]) -> pb.GenerateRequest:
    roles = ["user", "assistant"] * len(contents)
    messages = [pb.ChatMessage(role=r, content=c) for r, c in zip(roles, contents, strict=False)]
    return pb.GenerateRequest(chat=pb.ChatTurns(messages=messages), sampling=pb.SamplingOptions(max_tokens=2))


def _generate(mesh: Mesh, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    bearer = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        return list(stream_generate(channel, request, call_metadata(bearer), timeout_s=120))


def test_a_chat_of_hundreds_of_short_messages_is_screened_rather_than_refused(chat_mesh: Mesh) -> None:
    """Each message costs the screen at least one window, and the safety service screens 256 per
    check: a chat of 300 short messages, which the gateway accepts (up to MAX_CHAT_MESSAGES), was
    refused by safety as a text too long to screen. Its messages are screened, each of them: one
    harmful message among them blocks the chat."""
    contents = [f"ok {i}" for i in range(300)]
    assert len(contents) <= MAX_CHAT_MESSAGES
    answered = _generate(chat_mesh, _chat(contents))
    assert answered[-1].done.finish_reason != pb.FINISH_REASON_SAFETY
    contents[150] = SELF_HARM_PROMPT  # a user's message
    blocked = _generate(chat_mesh, _chat(contents))
    assert blocked[-1].done.finish_reason == pb.FINISH_REASON_SAFETY


def test_a_chat_too_long_to_screen_is_refused_with_what_to_send_instead(chat_mesh: Mesh) -> None:
    sentence = "The committee met on Tuesday to review the quarterly budget and the parking rules."
    contents = [f"{sentence} {sentence} Item {i}." for i in range(MAX_CHAT_MESSAGES)]  # none shares a window
    with pytest.raises(grpc.RpcError) as caught:
        _generate(chat_mesh, _chat(contents))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("safety: chat needs more than 256 screening windows")
    assert "send fewer or shorter messages" in caught.value.details()


def _decisions(mesh: Mesh, client_request_id: str) -> list[tuple[str, str]]:
    """(decision, reason) of the audit events of the calls that sent `client_request_id`."""
    events = [
        json.loads(line)
        for p in segment_paths(mesh.audit_dir, "decisions")
        for line in p.read_text().splitlines()
    ]
    return [(e["decision"], e["reason"]) for e in events if client_request_id_of(e) == client_request_id]


def _post_chat(
    mesh: Mesh, messages: list[dict[str, str]], client_request_id: str
) -> tuple[int, dict[str, Any]]:
    bearer = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    body = json.dumps({"model": "", "messages": messages, "max_tokens": 2}).encode()
    headers = {"Authorization": f"Bearer {bearer}", "X-Request-Id": client_request_id}
    url = urlsplit(mesh.http_url())
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        connection.request("POST", f"{url.path}/chat/completions", body, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("role", ["usr", "human", "user\u200b", "developer"])
def test_a_made_up_role_is_refused_by_the_gateway_on_both_fronts_before_its_allow_event(
    chat_mesh: Mesh, role: str
) -> None:
    """The engine refuses a role outside its chat roles; the gateway, which reads them from the
    engine's GetModelInfo, refuses it first, so such a chat costs no allow event and no screen."""
    says = f"chat message 1: role {role!r} is not one of system, user, assistant, tool"
    bearer = mint_token(chat_mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    grpc_id, http_id = f"grpc-{uuid.uuid4().hex}", f"http-{uuid.uuid4().hex}"
    turns = [pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role=role, content="go on")]
    request = pb.GenerateRequest(chat=pb.ChatTurns(messages=turns), sampling=pb.SamplingOptions(max_tokens=2))
    with (
        grpc.insecure_channel(chat_mesh.target("gateway")) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        list(stream_generate(channel, request, [*call_metadata(bearer), ("x-request-id", grpc_id)], 60))
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, says)
    status, answer = _post_chat(
        chat_mesh, [{"role": "user", "content": "hi"}, {"role": role, "content": "go on"}], http_id
    )
    assert (status, answer["error"]["message"]) == (400, says), answer
    assert _decisions(chat_mesh, grpc_id) == _decisions(chat_mesh, http_id) == [("deny", says)]


def test_every_role_the_engine_takes_passes_the_gateway(chat_mesh: Mesh) -> None:
    roles = ["system", "user", "assistant", "tool", "user"]
    messages = [pb.ChatMessage(role=r, content=f"turn {i}") for i, r in enumerate(roles)]
    request = pb.GenerateRequest(
        chat=pb.ChatTurns(messages=messages), sampling=pb.SamplingOptions(max_tokens=2)
    )
    assert _generate(chat_mesh, request)[-1].done.finish_reason == pb.FINISH_REASON_LENGTH
