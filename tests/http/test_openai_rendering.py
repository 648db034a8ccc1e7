"""The chat rendering, checked against the openai client's own response models (stories260K, the
test mesh's model, has no chat template, so no mesh test reaches a chat answer)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.common.errors import Unavailable
from services.gateway.http.openai_request import Endpoint, parse
from services.gateway.http.openai_response import Rendering, completed
from thermocline.gateway.v1 import gateway_pb2 as pb

BODY = {"model": "", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
DONE = pb.Completion(
    finish_reason=pb.FINISH_REASON_SAFETY,
    model="served-model",
    usage=pb.Usage(prompt_tokens=7, completion_tokens=3, cached_prompt_tokens=4),
)


def events(chunks: list[bytes]) -> list[str]:
    """The payloads of SSE events."""
    return [chunk.decode().removeprefix("data: ").strip() for chunk in chunks]


def test_a_chat_answer_parses_as_the_clients_chat_completion() -> None:
    parsed = parse(Endpoint.CHAT, BODY)
    assert [(m.role, m.content) for m in parsed.request.chat.messages] == [("user", "hi")]
    answer = ChatCompletion.model_validate(Rendering(parsed, "r1", "m").body("Hello", DONE))
    assert answer.id == "chatcmpl-r1" and answer.model == "served-model"
    assert answer.choices[0].message.content == "Hello"
    assert answer.choices[0].finish_reason == "content_filter"
    assert answer.usage is not None and answer.usage.total_tokens == 10
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_chunks_parse_as_the_clients_chunks_and_end_with_usage_then_done() -> None:
    parsed = parse(Endpoint.CHAT, BODY | {"stream": True, "stream_options": {"include_usage": True}})
    rendering = Rendering(parsed, "r2", "served-model")
    payloads = events(
        [rendering.chunk("Hel", is_first=True), rendering.chunk("lo"), *rendering.closing(DONE)]
    )
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "content_filter"
    assert not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert {chunk.model for chunk in chunks} == {"served-model"}


@pytest.mark.parametrize("reason", [pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_ERROR])
def test_an_answer_cut_short_is_an_error_not_a_stop(reason: int) -> None:
    # "stop" would pass a cancelled or failed answer off as whole (docs/http_api.md)
    with pytest.raises(Unavailable, match="retry the request"):
        completed(pb.GenerateResponse(done=pb.Completion(finish_reason=reason)))


def test_a_whole_answer_is_its_completion() -> None:
    assert completed(pb.GenerateResponse(done=DONE)) == DONE
