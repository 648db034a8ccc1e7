"""Bodies that no client library would send, posted raw to the real HTTP front: each is a 400
naming the field, never a 500 (protobuf's range and encoding errors, the JSON parser's limits)."""

from __future__ import annotations

import json

import pytest

from tests.http.conftest import HttpGateway

COMPLETION = {"model": "", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0.0}
CHAT = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"max_tokens": 2**32}, "max_tokens", "below 2**32"),
        ({"max_completion_tokens": 2**32 + 5}, "max_completion_tokens", "below 2**32"),
        ({"top_k": 2**32}, "top_k", "below 2**32"),
        ({"seed": 2**63}, "seed", "below 2**63"),
    ],
)
def test_an_integer_beyond_its_protobuf_type_names_the_field(
    http_gateway: HttpGateway, fields: dict[str, int], param: str, says: str
) -> None:
    answer = http_gateway.post("/completions", json.dumps(COMPLETION | fields).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == param and says in answer.error["message"]


# json.dumps keeps "\ud800" as the escape JSON allows; Python decodes it to a lone surrogate.
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", COMPLETION | {"prompt": "Once \ud800 upon"}, "prompt"),
        ("/completions", COMPLETION | {"prompt": ["\udfff"]}, "prompt"),
        ("/completions", COMPLETION | {"stop": ["ok", "\ud800"]}, "stop"),
        ("/completions", COMPLETION | {"model": "\ud800"}, "model"),
        ("/completions", COMPLETION | {"user": "\ud800"}, "user"),
        ("/chat/completions", CHAT | {"messages": [{"role": "\udfff", "content": "hi"}]}, "messages[0].role"),
        (
            "/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_a_lone_surrogate_names_the_field(
    http_gateway: HttpGateway, path: str, body: dict[str, object], param: str
) -> None:
    answer = http_gateway.post(path, json.dumps(body).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == param and "surrogate" in answer.error["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[" * 50_000 + b"]" * 50_000, "nests too deeply"),
        (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nests too deeply"),
        (b'{"prompt": "x", "seed": ' + b"1" * 4301 + b"}", "4300 digits"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_a_body_the_json_parser_cannot_take_is_a_400(
    http_gateway: HttpGateway, body: bytes, says: str
) -> None:
    answer = http_gateway.post("/completions", body)
    assert answer.status == 400, answer.body
    assert answer.error["type"] == "invalid_request_error" and says in answer.error["message"]
    assert "set_int_max_str_digits" not in answer.error["message"]
