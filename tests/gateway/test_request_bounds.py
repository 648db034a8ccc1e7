"""The prompt byte limit counts UTF-8 bytes, of a prompt or of every chat turn, and names the limit."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from services.common.errors import InvalidArgument
from services.gateway.call_metadata import CallMetadata
from services.gateway.request_bounds import (
    EngineLimits,
    RequestBounds,
    check_engine_limits,
    check_metadata,
    check_prompt_size,
    prompt_bytes,
)
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb


def _chat(*turns: tuple[str, str]) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in turns]
    return pb.GenerateRequest(chat=pb.ChatTurns(messages=messages))


def test_bytes_are_counted_in_utf8_for_ascii_and_other_text() -> None:
    assert prompt_bytes(pb.GenerateRequest(prompt="abc")) == 3
    assert prompt_bytes(pb.GenerateRequest(prompt="é€𝄞")) == 2 + 3 + 4
    assert prompt_bytes(_chat(("user", "héllo"), ("assistant", "ok"))) == 4 + 6 + 9 + 2


def test_a_prompt_at_the_limit_passes_and_one_byte_over_is_refused_with_the_limit() -> None:
    bounds = RequestBounds(max_prompt_bytes=10)
    check_prompt_size(pb.GenerateRequest(prompt="€" * 3 + "a"), bounds)
    with pytest.raises(
        InvalidArgument, match=r"prompt is 11 bytes \(UTF-8\); this gateway accepts at most 10"
    ):
        check_prompt_size(pb.GenerateRequest(prompt="€" * 3 + "ab"), bounds)
    with pytest.raises(InvalidArgument, match="prompt is 11 bytes"):
        check_prompt_size(_chat(("user", "€" * 2), ("x", "")), bounds)


def test_a_default_completion_length_under_one_token_is_refused_with_its_setting() -> None:
    with pytest.raises(ValueError, match="THERMOCLINE_GATEWAY_DEFAULT_MAX_TOKENS must be at least 1, got 0"):
        RequestBounds(default_max_tokens=0)


@pytest.mark.parametrize("mode", ["", "off", "semantic"])
def test_known_retrieval_modes_pass(mode: str) -> None:
    check_metadata(CallMetadata([("x-retrieval-mode", mode)]))


def test_an_unknown_retrieval_mode_is_refused_at_the_gateway_with_the_known_ones() -> None:
    expected = r"unknown retrieval mode 'Semantic'.*known modes: off, semantic"
    with pytest.raises(InvalidArgument, match=expected):
        check_metadata(CallMetadata([("x-retrieval-mode", "Semantic")]))


@pytest.mark.parametrize("key", ["x-intent", "x-request-id", "x-retrieval-mode"])
def test_a_metadata_entry_the_gateway_reads_is_refused_when_sent_twice(key: str) -> None:
    check_metadata(CallMetadata([(key, "off"), ("x-other", "a"), ("x-other", "b")]))
    with pytest.raises(InvalidArgument, match=f"2 '{key}' metadata entries sent; send it once"):
        check_metadata(CallMetadata([(key, "off"), (key, "off")]))


ENGINE = EngineLimits(has_chat_template=True, max_tokens_limit=4096, chat_roles=("system", "user"))


def test_engine_limits_are_read_from_model_info_and_an_older_engine_reports_none() -> None:
    info = engine_pb2.GetModelInfoResponse(has_chat_template=True, max_tokens_limit=4096)
    info.chat_roles.extend(["system", "user"])
    assert EngineLimits.of(info) == ENGINE
    older = EngineLimits.of(engine_pb2.GetModelInfoResponse(has_chat_template=True))
    assert older == EngineLimits(has_chat_template=True, max_tokens_limit=None, chat_roles=())
    # what the engine checks itself is let through to it
    check_engine_limits(_chat(("developer", "hi")), 5000, "m", older)


def test_a_request_within_the_engines_limits_passes() -> None:
    check_engine_limits(pb.GenerateRequest(prompt="hi"), 4096, "m", ENGINE)
    check_engine_limits(_chat(("system", "be brief"), ("user", "hi")), 1, "m", ENGINE)


@pytest.mark.parametrize(
    ("request_", "max_tokens", "limits", "says"),
    [
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=4097)),
            4097,
            ENGINE,
            "max_tokens 4097 exceeds this engine's limit of 4096; ask for at most 4096",
        ),
        (_chat(("user", "hi")), 1, replace(ENGINE, has_chat_template=False), "model m has no chat template"),
        (
            _chat(("user", "hi"), ("tool", "x")),
            1,
            ENGINE,
            "chat message 1: role 'tool' is not one of system, user",
        ),
    ],
    ids=["max_tokens", "no-template", "role"],
)
def test_what_the_engine_would_refuse_is_refused_in_its_words(
    request_: pb.GenerateRequest, max_tokens: int, limits: EngineLimits, says: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(says)):
        check_engine_limits(request_, max_tokens, "m", limits)
