"""Bodies that no client library would send, posted raw to the real HTTP front: each is a 400
naming the field, never a 500 (protobuf's range and encoding errors, the JSON parser's limits)."""

from __future__ import annotations

import codecs
import json
import uuid

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


@pytest.mark.parametrize("temperature", [1e-50, -1e-50, 0.0005])
def test_a_temperature_too_small_to_sample_with_is_refused_not_run_greedy(
    http_gateway: HttpGateway, temperature: float
) -> None:
    """float32 rounds 1e-50 to 0, which the gateway's range check reads as greedy."""
    answer = http_gateway.post("/completions", json.dumps(COMPLETION | {"temperature": temperature}).encode())
    assert answer.status == 400, answer.body
    assert "temperature" in answer.error["message"] and "[0.001, 100]" in answer.error["message"]


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
        (codecs.BOM_UTF8 + json.dumps(COMPLETION).encode(), "byte order mark"),
        (json.dumps(COMPLETION).encode("utf-16"), "not UTF-8"),  # with its BOM, FF FE
        (json.dumps(COMPLETION).encode("utf-16-le"), "NUL byte"),
        (json.dumps(COMPLETION).encode("utf-32-be"), "NUL byte"),
        (json.dumps(COMPLETION | {"prompt": "Once"}).encode().replace(b"Once", b"On\xe9e"), "not UTF-8"),
    ],
)
def test_a_body_the_json_parser_cannot_take_is_a_400(
    http_gateway: HttpGateway, body: bytes, says: str
) -> None:
    answer = http_gateway.post("/completions", body)
    assert answer.status == 400, answer.body
    assert answer.error["type"] == "invalid_request_error" and says in answer.error["message"]
    assert "set_int_max_str_digits" not in answer.error["message"]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"max_tokens": "junk", "max_completion_tokens": 3}, "max_tokens", "non-negative integer"),
        ({"max_tokens": 0, "max_completion_tokens": 3}, "max_tokens", "at least 1"),
        ({"max_tokens": 5, "max_completion_tokens": 3}, "max_completion_tokens", "'max_tokens' is 5"),
    ],
    ids=["junk-beside-the-newer-name", "zero-beside-the-newer-name", "two-limits"],
)
def test_both_names_of_the_length_limit_are_checked(
    http_gateway: HttpGateway, fields: dict[str, object], param: str, says: str
) -> None:
    answer = http_gateway.post("/chat/completions", json.dumps(CHAT | fields).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == param and says in answer.error["message"]


def test_the_same_limit_under_both_names_is_served(http_gateway: HttpGateway) -> None:
    body = COMPLETION | {"max_tokens": 2, "max_completion_tokens": 2}
    answer = http_gateway.post("/completions", json.dumps(body).encode())
    assert answer.status == 200, answer.body
    assert answer.body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": True}, "n"),
        ({"best_of": True}, "best_of"),
        ({"echo": 0}, "echo"),
        ({"frequency_penalty": False}, "frequency_penalty"),
    ],
)
def test_a_default_only_field_takes_its_default_in_its_json_type(
    http_gateway: HttpGateway, fields: dict[str, object], param: str
) -> None:
    # Python's True == 1 and 0 == False let these through as the default
    answer = http_gateway.post("/completions", json.dumps(COMPLETION | fields).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == param


def test_default_only_fields_at_their_defaults_pass(http_gateway: HttpGateway) -> None:
    fields = {"n": 1, "best_of": 1, "echo": False, "frequency_penalty": 0.0, "presence_penalty": 0}
    answer = http_gateway.post("/completions", json.dumps(COMPLETION | fields).encode())
    assert answer.status == 200, answer.body


@pytest.mark.parametrize("value", [[[0] * 10] * 1000, "yes", 1])
def test_parallel_tool_calls_takes_only_a_boolean(http_gateway: HttpGateway, value: object) -> None:
    body = CHAT | {"parallel_tool_calls": value}
    answer = http_gateway.post("/chat/completions", json.dumps(body).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == "parallel_tool_calls" and "true or false" in answer.error["message"]


def test_parallel_tool_calls_false_passes_the_front(http_gateway: HttpGateway) -> None:
    body = CHAT | {"parallel_tool_calls": False}
    answer = http_gateway.post("/chat/completions", json.dumps(body).encode())
    # the test model has no chat template: the engine's refusal shows the front let the body through
    assert "no chat template" in answer.error["message"], answer.body


def test_a_message_name_is_refused_not_dropped(http_gateway: HttpGateway) -> None:
    body = CHAT | {"messages": [{"role": "user", "name": "n" * 100_000, "content": "hi"}]}
    answer = http_gateway.post("/chat/completions", json.dumps(body).encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == "messages[0].name" and "content" in answer.error["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "nope", "model": "", "prompt": "Once upon a time", "max_tokens": 2}',
        b'{"model": "", "prompt": "Once upon a time", "max_tokens": 2, '
        b'"stream": true, "stream_options": {"include_usage": true, "include_usage": false}}',
    ],
    ids=["top-level", "nested"],
)
def test_a_repeated_key_is_refused_at_any_depth(http_gateway: HttpGateway, body: bytes) -> None:
    answer = http_gateway.post("/completions", body)
    assert answer.status == 400, answer.body
    assert "repeats the key" in answer.error["message"]
    assert answer.error["message"].split("'")[1] in ("model", "include_usage")


# Every numeric field of each endpoint, at an integer past float's range (float() raises
# OverflowError) and at a float literal that parses to inf.
_NUMERIC_FIELDS = {
    "/completions": ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
                     "best_of", "logprobs", "frequency_penalty", "presence_penalty"),
    "/chat/completions": ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                          "n", "top_logprobs", "frequency_penalty", "presence_penalty"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "param", "literal"),
    [
        (path, param, literal)
        for path, params in _NUMERIC_FIELDS.items()
        for param in params
        for literal in ("1" + "0" * 400, "1e999")
    ],
    ids=lambda value: "10**400" if value.startswith("1000") else value,
)
def test_a_number_beyond_float_range_names_the_field(
    http_gateway: HttpGateway, path: str, param: str, literal: str
) -> None:
    base = COMPLETION if path == "/completions" else CHAT
    body = json.dumps({k: v for k, v in base.items() if k != param})[:-1] + f', "{param}": {literal}}}'
    answer = http_gateway.post(path, body.encode())
    assert answer.status == 400, answer.body
    assert answer.error["param"] == param, answer.error


def test_a_max_tokens_over_the_engines_limit_is_refused_before_the_allow_event(
    http_gateway: HttpGateway,
) -> None:
    client_id = f"over-the-limit-{uuid.uuid4().hex}"
    body = json.dumps(COMPLETION | {"max_tokens": 5000}).encode()
    answer = http_gateway.post("/completions", body, {"X-Request-Id": client_id})
    assert answer.status == 400, answer.body
    assert (
        answer.error["message"] == "max_tokens 5000 exceeds this engine's limit of 4096; ask for at most 4096"
    )
    assert [e["decision"] for e in http_gateway.audit_events(client_id)] == ["deny"]
