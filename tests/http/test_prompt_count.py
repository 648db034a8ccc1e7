"""Prompt tokens counted by the engine's CountTokens, and the gateway's cache in front of it."""

from __future__ import annotations

import grpc
import openai
import pytest

from services.cli.mesh import Mesh
from tests.conftest import STORIES_PROMPT, STORIES_PROMPT_IDS, rpcs_handled
from tests.http.conftest import HttpGateway
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

COUNT_TOKENS = "/thermocline.engine.v1.EngineService/CountTokens"


def count_tokens(mesh: Mesh, request: engine_pb2.CountTokensRequest) -> engine_pb2.CountTokensResponse:
    """The engine's CountTokens, called directly."""
    with mesh.channel("engine") as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).CountTokens(request, timeout=30)


def engine_counts_served(mesh: Mesh) -> float:
    """How many CountTokens calls the engine has answered OK, from its /metrics."""
    return rpcs_handled(f"http://127.0.0.1:{mesh.config.ports.metrics['engine']}/metrics", COUNT_TOKENS, "OK")


def test_the_engine_counts_as_generate_tokenizes(http_gateway: HttpGateway) -> None:
    counted = count_tokens(http_gateway.mesh, engine_pb2.CountTokensRequest(prompt=STORIES_PROMPT))
    assert counted.num_tokens == len(STORIES_PROMPT_IDS)  # BOS included, as Generate sees it
    assert counted.model
    chat = engine_pb2.ChatTurns(messages=[engine_pb2.ChatMessage(role="user", content="hi")])
    with pytest.raises(grpc.RpcError) as refused:
        count_tokens(http_gateway.mesh, engine_pb2.CountTokensRequest(chat=chat))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in (refused.value.details() or "")


def test_the_gateway_asks_the_engine_once_per_model_and_prompt(http_gateway: HttpGateway) -> None:
    client = openai.OpenAI(
        base_url=http_gateway.base_url,
        api_key=http_gateway.user_token,
        max_retries=0,
        default_headers={"X-Intent": "chat"},
    )
    prompt = f"{STORIES_PROMPT} there was a cat named Tom"  # asked by no other test
    before = engine_counts_served(http_gateway.mesh)
    answers = [client.completions.create(model="", prompt=prompt, max_tokens=1) for _ in range(3)]
    assert engine_counts_served(http_gateway.mesh) - before == 1
    assert len({a.usage.prompt_tokens for a in answers if a.usage}) == 1
