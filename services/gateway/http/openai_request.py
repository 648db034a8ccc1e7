"""OpenAI request bodies turned into the gateway's GenerateRequest, or refused naming the field.

Every field the OpenAI API defines for the two endpoints is either honoured (mapped onto the
request), accepted only at its default value (it changes nothing here), or refused with a 400
that names it and says what would work. A field the API does not define is refused too: a
misspelt `max_token` silently ignored would cost the caller a full-length completion. A chat
message's `name` is refused for the same reason: the engine's chat template has no slot for it,
so a name dropped on the floor would be a turn the model reads differently than the caller meant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from services.common.errors import InvalidArgument
from services.gateway.request_bounds import MAX_TEMPERATURE, MIN_TEMPERATURE
from thermocline.gateway.v1 import gateway_pb2 as pb

MAX_USER_CHARS = 256
# Bits of each integer field's protobuf type: a larger value is refused by name, never left to
# protobuf's ValueError. seed is uint64 on the wire, but the engine takes at most 2**63 - 1.
_UINT32_BITS = 32
_SEED_BITS = 63
_MAX_TOKENS_NAMES = ("max_tokens", "max_completion_tokens")


class Endpoint(Enum):
    """The two generation endpoints; they differ in input and output shapes."""

    CHAT = "chat.completion"
    COMPLETIONS = "text_completion"


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed body: the gRPC request plus what only the HTTP answer needs."""

    endpoint: Endpoint
    request: pb.GenerateRequest
    is_stream: bool
    include_usage: bool
    user: str


def _is_default(default: Any) -> Callable[[Any], bool]:
    """Whether a value is absent or `default`, a JSON boolean never standing for a number nor a
    number for a boolean (in Python True == 1 and 0 == False, so `n: true` passed as n=1)."""

    def is_default(value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) or isinstance(default, bool):
            return value is default
        return bool(value == default)

    return is_default


def _no_logprobs(value: Any) -> bool:
    return value is None or value is False or value == 0


def _text_format(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


# Fields accepted only at values that change nothing, and what a caller should send instead.
_DEFAULT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_is_default(1), "only n=1 is supported; send one request per choice"),
    "logprobs": (_no_logprobs, "log probabilities are not returned by this server; omit logprobs"),
    "top_logprobs": (_no_logprobs, "log probabilities are not returned by this server; omit top_logprobs"),
    "response_format": (_text_format, "only {'type': 'text'} is supported; JSON modes are not enforced here"),
    "frequency_penalty": (_is_default(0), "penalties are not supported; send 0 or omit it"),
    "presence_penalty": (_is_default(0), "penalties are not supported; send 0 or omit it"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported; omit it"),
    "best_of": (_is_default(1), "only best_of=1 is supported"),
    "echo": (_is_default(False), "echo is not supported; the prompt is not repeated in the answer"),
    "suffix": (_is_default(None), "suffix (insertion) is not supported"),
    "parallel_tool_calls": (
        lambda v: v is None or isinstance(v, bool),
        "must be true or false (no tools are called here, so either changes nothing)",
    ),
    "tools": (lambda v: not v, "tool calling is not supported; omit tools"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported; omit tool_choice"),
}
_HONOURED = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
}
_FIELDS = {
    Endpoint.CHAT: _HONOURED | {"messages"} | _DEFAULT_ONLY.keys() - {"best_of", "echo", "suffix"},
    Endpoint.COMPLETIONS: _HONOURED | {"prompt"} | _DEFAULT_ONLY.keys() - {"tools", "tool_choice"},
}


def parse(endpoint: Endpoint, body: Any) -> OpenAIRequest:
    """The request a body asks for; INVALID_ARGUMENT naming the first field that cannot be served."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    _check_fields(endpoint, body)
    request = pb.GenerateRequest(model=_string(body, "model", ""), sampling=_sampling(body))
    if endpoint is Endpoint.CHAT:
        request.chat.messages.extend(_messages(body.get("messages")))
    else:
        request.prompt = _prompt(body.get("prompt"))
    is_stream = _bool(body, "stream")
    return OpenAIRequest(endpoint, request, is_stream, _include_usage(body, is_stream), _user(body))


def _check_fields(endpoint: Endpoint, body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name not in _FIELDS[endpoint]:
            known = ", ".join(sorted(_FIELDS[endpoint]))
            raise InvalidArgument(
                f"unknown field {name!r} for {endpoint.value}; this server accepts: {known}"
            )
        if name in _DEFAULT_ONLY:
            is_served, advice = _DEFAULT_ONLY[name]
            if not is_served(value):
                raise InvalidArgument(f"field {name!r}: {advice}")


def _sampling(body: dict[str, Any]) -> pb.SamplingOptions:
    temperature = _number(body, "temperature", 1.0)
    if 0.0 < abs(temperature) < MIN_TEMPERATURE:  # float32 would round 1e-50 to 0, i.e. greedy
        raise InvalidArgument(
            f"field 'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
            f"got {temperature:g}"
        )
    sampling = pb.SamplingOptions(
        max_tokens=_max_tokens(body),
        temperature=temperature,
        top_p=_number(body, "top_p", 0.0),
        top_k=_integer(body, "top_k", 0, _UINT32_BITS),
        stop=_stop(body.get("stop")),
    )
    if body.get("top_p") is not None and sampling.top_p == 0.0:
        sampling.top_k = 1  # a nucleus of no mass: OpenAI's greedy, where the gRPC API's 0 is off
    if body.get("seed") is not None:
        sampling.seed = _integer(body, "seed", 0, _SEED_BITS)
    return sampling


def _max_tokens(body: dict[str, Any]) -> int:
    """The completion's length limit (0: the gateway's default); both names are checked, and
    when both are sent they must agree, so no reader of the body sees another limit."""
    given = {name: _positive(body, name) for name in _MAX_TOKENS_NAMES if body.get(name) is not None}
    if len(set(given.values())) > 1:
        raise InvalidArgument(
            f"field 'max_completion_tokens' is {given['max_completion_tokens']} but 'max_tokens' is "
            f"{given['max_tokens']}; send one of them (max_tokens is the older name of the same limit)"
        )
    return next(iter(given.values()), 0)


def _positive(body: dict[str, Any], name: str) -> int:
    value = _integer(body, name, 0, _UINT32_BITS)
    if value < 1:
        raise InvalidArgument(f"field {name!r} must be at least 1, got {value}")
    return value


def _messages(value: Any) -> list[pb.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument("field 'messages' must be a non-empty list of {role, content} objects")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(index: int, message: Any) -> pb.ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidArgument(f"field {where!r} must be an object with a string 'role'")
    if "name" in message:
        raise InvalidArgument(
            f"field '{where}.name' is not supported: the chat template has no slot for a "
            "participant's name; put it in the message's content"
        )
    extra = set(message) - {"role", "content"}
    if extra:
        raise InvalidArgument(f"field {where}.{sorted(extra)[0]!r} is not supported (no tool calls here)")
    role = _unicode(f"{where}.role", message["role"])
    return pb.ChatMessage(role=role, content=_content(where, message.get("content")))


def _content(where: str, content: Any) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return _unicode(f"{where}.content", content)
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return _unicode(f"{where}.content", "".join(part["text"] for part in content))
    raise InvalidArgument(
        f"field '{where}.content' must be a string or a list of text parts; images are not served"
    )


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return _unicode("prompt", value[0])
    if not isinstance(value, str):
        raise InvalidArgument(
            "field 'prompt' must be one string (a list of one string is accepted); "
            "batched prompts and token arrays are not supported: send one request per prompt"
        )
    return _unicode("prompt", value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [_unicode("stop", value)]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [_unicode("stop", s) for s in value]
    raise InvalidArgument("field 'stop' must be a string or a list of strings")


def _include_usage(body: dict[str, Any], is_stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not is_stream:
        raise InvalidArgument("field 'stream_options' is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidArgument("field 'stream_options' takes only {'include_usage': true|false}")
    return _bool(options, "include_usage")


def _user(body: dict[str, Any]) -> str:
    user = _string(body, "user", "")
    if len(user) > MAX_USER_CHARS:
        raise InvalidArgument(f"field 'user' is {len(user)} characters; at most {MAX_USER_CHARS} are allowed")
    return user


def _string(body: dict[str, Any], name: str, default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidArgument(f"field {name!r} must be a string")
    return _unicode(name, value)


def _unicode(name: str, text: str) -> str:
    """`text`, once it is known to encode as UTF-8: JSON can spell a lone surrogate ("\\ud800"),
    which neither protobuf, the audit log nor the trace exporter can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(
            f"field {name!r} holds a lone UTF-16 surrogate at character {error.start}; "
            "send text that is valid Unicode"
        ) from None
    return text


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"field {name!r} must be true or false")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"field {name!r} must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer literal past float's range: 10**400
        number = math.inf
    if not math.isfinite(number):  # a float literal past it parses to inf: 1e999
        raise InvalidArgument(f"field {name!r} must be a finite number; this one is beyond float's range")
    return number


def _integer(body: dict[str, Any], name: str, default: int, num_bits: int) -> int:
    """A non-negative integer that fits the field's `num_bits`-bit protobuf type."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**num_bits:
        raise InvalidArgument(f"field {name!r} must be a non-negative integer below 2**{num_bits}")
    return value
