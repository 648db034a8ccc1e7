"""The engine serves the mesh's services only: a call without the service token, or with another
one, is UNAUTHENTICATED and names the setting, so nobody who reaches its port can generate past the
gateway's JWT, RBAC, rate limits and audit; health stays open for the probes and the router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.cli.mesh import Mesh
from services.common.service_auth import TOKEN_FILE_SETTING, ServiceToken, authenticated
from tests.conftest import STORIES_PROMPT
from tests.engine.engine_process import start_engine
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc

WRONG_TOKEN = ServiceToken("0" * 64, Path("/nowhere"))
GENERATE = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingParams(max_tokens=2))


@pytest.fixture(scope="module")
def engine(stories_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """An engine process serving stories260K, holding the service token its mesh made."""
    mesh = start_engine(stories_hf_dir, tmp_path_factory.mktemp("auth-engine"))
    yield mesh
    mesh.stop()


def assert_refused(channel: grpc.Channel) -> None:
    """A unary and a streaming call on `channel` are both UNAUTHENTICATED, naming the setting."""
    stub = pb_grpc.EngineServiceStub(channel)
    for call in (
        lambda: stub.CountTokens(pb.CountTokensRequest(prompt=STORIES_PROMPT), timeout=60),
        lambda: list(stub.Generate(GENERATE, timeout=60)),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, raised.value
        assert TOKEN_FILE_SETTING in raised.value.details()


def test_a_call_without_the_token_is_refused(engine: Mesh) -> None:
    with grpc.insecure_channel(engine.target("engine")) as channel:
        assert_refused(channel)


def test_a_call_with_another_token_is_refused(engine: Mesh) -> None:
    with authenticated(grpc.insecure_channel(engine.target("engine")), WRONG_TOKEN) as channel:
        assert_refused(channel)


def test_a_call_with_the_token_is_served(engine: Mesh) -> None:
    with engine.channel("engine") as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        assert stub.CountTokens(pb.CountTokensRequest(prompt=STORIES_PROMPT), timeout=60).num_tokens > 0
        replies = list(stub.Generate(GENERATE, timeout=60))
    assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_health_and_reflection_answer_without_a_token(engine: Mesh) -> None:
    with grpc.insecure_channel(engine.target("engine")) as channel:
        for name in ("", "thermocline.engine.v1.EngineService"):
            request = health_pb2.HealthCheckRequest(service=name)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        asked = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([asked]), timeout=30
        )
        listed = [service.name for service in next(replies).list_services_response.service]
    assert "thermocline.engine.v1.EngineService" in listed
