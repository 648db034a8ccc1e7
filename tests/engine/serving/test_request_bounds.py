"""The engine API's bounds on caller-supplied fields (services/engine/serving/request_bounds.py),
through an engine process on stories260K: each is refused with INVALID_ARGUMENT, early, with a
message that names the limit and echoes no more than a short cut of the value."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.engine.serving.request_bounds import (
    MAX_CACHE_SALT_BYTES,
    MAX_COUNT_CHARS,
    MAX_INTENT_CLASS_CHARS,
    MAX_REQUEST_ID_CHARS,
)
from tests.conftest import STORIES_PROMPT
from tests.engine.engine_process import start_engine
from thermocline.engine.v1 import engine_pb2 as pb
from thermocline.engine.v1 import engine_pb2_grpc as pb_grpc

MAX_MESSAGE_CHARS = 1024  # no refusal's message is longer


@pytest.fixture(scope="module")
def stub(
    stories_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[pb_grpc.EngineServiceStub]:
    """A stub for an engine process serving stories260K."""
    mesh = start_engine(stories_hf_dir, tmp_path_factory.mktemp("bounds-engine"))
    with mesh.channel("engine") as channel:
        yield pb_grpc.EngineServiceStub(channel)
    mesh.stop()


def _refusal(stub: pb_grpc.EngineServiceStub, **fields: object) -> grpc.RpcError:
    request = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingParams(max_tokens=1), **fields)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(request, timeout=60))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert len(raised.value.details()) < MAX_MESSAGE_CHARS
    return raised.value


def test_an_intent_class_over_its_bound_is_refused_with_a_short_message(
    stub: pb_grpc.EngineServiceStub,
) -> None:
    refused = _refusal(stub, intent_class="C" * 40_000)
    assert f"class names have at most {MAX_INTENT_CLASS_CHARS}" in refused.details()
    assert "40,000 characters" in refused.details()


def test_an_unknown_intent_class_is_cut_in_the_message(stub: pb_grpc.EngineServiceStub) -> None:
    refused = _refusal(stub, intent_class="u" * MAX_INTENT_CLASS_CHARS)
    assert "unknown intent_class" in refused.details() and "known classes" in refused.details()


def test_a_cache_salt_over_its_bound_is_refused_and_one_at_it_is_served(
    stub: pb_grpc.EngineServiceStub,
) -> None:
    for salt in ("s" * 15_000_000, "s" * (MAX_CACHE_SALT_BYTES + 1), "é" * (MAX_CACHE_SALT_BYTES // 2 + 1)):
        refused = _refusal(stub, cache_salt=salt)
        assert f"cache_salt has more than {MAX_CACHE_SALT_BYTES} UTF-8 bytes" in refused.details()
    at_bound = pb.GenerateRequest(
        prompt=STORIES_PROMPT, sampling=pb.SamplingParams(max_tokens=1), cache_salt="s" * MAX_CACHE_SALT_BYTES
    )
    assert list(stub.Generate(at_bound, timeout=60))[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_request_id_over_its_bound_is_refused(stub: pb_grpc.EngineServiceStub) -> None:
    refused = _refusal(stub, request_id="r" * (MAX_REQUEST_ID_CHARS + 1))
    assert f"at most {MAX_REQUEST_ID_CHARS} are allowed" in refused.details()


def test_counttokens_counts_up_to_its_bound_and_refuses_more(stub: pb_grpc.EngineServiceStub) -> None:
    at_bound = stub.CountTokens(pb.CountTokensRequest(prompt="a" * MAX_COUNT_CHARS), timeout=60)
    assert at_bound.num_tokens > 1
    chat = pb.ChatTurns(messages=[pb.ChatMessage(role="user", content="a" * (MAX_COUNT_CHARS // 2))] * 2)
    for request in (
        pb.CountTokensRequest(prompt="a" * (MAX_COUNT_CHARS + 1)),
        pb.CountTokensRequest(chat=chat),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            stub.CountTokens(request, timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert f"CountTokens counts at most {MAX_COUNT_CHARS:,} characters" in raised.value.details()
