"""Size and range limits on every caller-supplied field, checked before the field is used.

A field's size is checked before it reaches a message, a log line, the audit log, the tokenizer
or the engine; each refusal is INVALID_ARGUMENT and states the limit. Sampling ranges follow the
engine's documented ones (services/engine/scheduling/sampling_params.py), and the limits of the
engine serving the model come from its GetModelInfo (`EngineLimits`), so a request the engine
would refuse is refused here, before it spends a safety check or an engine slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.gateway.call_metadata import CLIENT_REQUEST_ID_KEY, CallMetadata
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2 as pb

MAX_MODEL_CHARS = 128
# The safety service screens a chat of this many messages when they are short (a few words each:
# they share its windows, services/safety/chat.py); a chat it cannot screen in
# THERMOCLINE_SAFETY_MAX_WINDOWS it refuses, INVALID_ARGUMENT, saying to send fewer or shorter messages.
MAX_CHAT_MESSAGES = 1024
MAX_ROLE_CHARS = 32
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_METADATA_VALUE_CHARS = 256  # x-intent, x-request-id, x-retrieval-mode; the token: below
MAX_TOKEN_CHARS = 16 * 1024  # a bearer token (auth.py); the HTTP front's head must hold one
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MAX_TOP_K = 1 << 20
MAX_SEED = 2**63 - 1
# The safety service refuses texts over 1,000,000 characters; a prompt never gets that far.
MAX_PROMPT_BYTES_CEILING = 1_000_000
# What a request may carry besides its prompt: chat roles and framing, stop strings, the model name.
_ENVELOPE_BYTES = 128 * 1024
RETRIEVAL_MODE_HEADER = "x-retrieval-mode"  # passed on to the engine (engine.proto, retrieval_mode)
_CHECKED_METADATA = ("x-intent", CLIENT_REQUEST_ID_KEY, RETRIEVAL_MODE_HEADER)
RETRIEVAL_MODES = ("off", "semantic")  # the values engine.proto documents; empty: the class's default


@dataclass(frozen=True)
class RequestBounds:
    """`THERMOCLINE_GATEWAY_MAX_PROMPT_BYTES`: the largest prompt (or sum of chat turns) in UTF-8 bytes.
    `THERMOCLINE_GATEWAY_DEFAULT_MAX_TOKENS`: the completion length of a request that gives none. The
    gateway charges the tenant's token budget for it and sends it to the engine explicitly, so it
    must not exceed the engine's `THERMOCLINE_ENGINE_MAX_TOKENS_LIMIT`.

    The gateway's gRPC server refuses any message larger than `max_message_bytes` before parsing
    it, so an oversized prompt costs neither a parse nor the event loop's time.
    """

    max_prompt_bytes: int = 512 * 1024
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_DEFAULT_MAX_TOKENS must be at least 1, got {self.default_max_tokens}"
            )
        if not 1 <= self.max_prompt_bytes <= MAX_PROMPT_BYTES_CEILING:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_MAX_PROMPT_BYTES must lie in 1..{MAX_PROMPT_BYTES_CEILING} "
                f"(the safety service's limit), got {self.max_prompt_bytes}"
            )

    @property
    def max_message_bytes(self) -> int:
        """The largest GenerateRequest the gRPC server accepts: the prompt plus its envelope."""
        return self.max_prompt_bytes + _ENVELOPE_BYTES


@dataclass(frozen=True)
class EngineLimits:
    """What the engine serving a model refuses, as its GetModelInfo reports it: the gateway refuses
    the same requests first, in the engine's words, before their allow event, token reservation
    and screen. A limit the engine does not report (one older than the field: `max_tokens_limit`
    None, `chat_roles` empty) is not checked here; the engine still refuses, after admission."""

    has_chat_template: bool
    max_tokens_limit: int | None = None
    chat_roles: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: engine_pb2.GetModelInfoResponse) -> EngineLimits:
        """The limits a GetModelInfo answer carries."""
        limit = info.max_tokens_limit if info.HasField("max_tokens_limit") else None
        return cls(info.has_chat_template, limit, tuple(info.chat_roles))


def utf8_bytes(text: str) -> int:
    """`len(text.encode())` without the copy when the text is ASCII (CPython knows that in O(1))."""
    return len(text) if text.isascii() else len(text.encode())


def prompt_bytes(request: pb.GenerateRequest) -> int:
    """The prompt's size in UTF-8 bytes (every chat turn's role and content)."""
    if request.WhichOneof("input") == "chat":
        return sum(utf8_bytes(m.role) + utf8_bytes(m.content) for m in request.chat.messages)
    return utf8_bytes(request.prompt)


def check_metadata(metadata: CallMetadata) -> None:
    """INVALID_ARGUMENT when a metadata entry the gateway reads is sent twice or oversized, or a
    retrieval mode is one the engine does not know (refused here, before the call's allow event
    and its screen). Two entries under one key are refused as two credentials are: readers
    disagree on which copy counts (this gateway reads the first), so a proxy that read the other
    would have checked another call than the one served."""
    for key in _CHECKED_METADATA:
        values = metadata.get_all(key)
        if len(values) > 1:
            raise InvalidArgument(f"{len(values)} '{key}' metadata entries sent; send it once")
        value = values[0] if values else ""
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidArgument(
                f"metadata '{key}' is {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS} are allowed"
            )
    mode = metadata.get(RETRIEVAL_MODE_HEADER, "")
    if mode and mode not in RETRIEVAL_MODES:
        raise InvalidArgument(
            f"unknown retrieval mode {mode[:40]!r} ({RETRIEVAL_MODE_HEADER}); "
            f"known modes: {', '.join(RETRIEVAL_MODES)}, or none for the intent's default"
        )


def check_prompt_size(request: pb.GenerateRequest, bounds: RequestBounds) -> None:
    """INVALID_ARGUMENT, naming the limit, when the prompt is over `THERMOCLINE_GATEWAY_MAX_PROMPT_BYTES`.

    Counting is one pass over the prompt (55 us for 512 KiB of ASCII); `request.ByteSize()` is no
    shortcut: on a freshly parsed message it took 690 us for the same prompt.
    """
    size = prompt_bytes(request)
    if size > bounds.max_prompt_bytes:
        raise InvalidArgument(
            f"prompt is {size} bytes (UTF-8); this gateway accepts at most {bounds.max_prompt_bytes}; "
            "shorten it or split the work"
        )


def check_sizes(request: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT, naming the limit, when any other string or list of the request is oversized."""
    if len(request.model) > MAX_MODEL_CHARS:
        raise InvalidArgument(
            f"model name is {len(request.model)} characters; at most {MAX_MODEL_CHARS} are allowed"
        )
    _check_chat(request)
    _check_stop(request.sampling.stop)


def _check_chat(request: pb.GenerateRequest) -> None:
    if request.WhichOneof("input") != "chat":
        return
    messages = request.chat.messages
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(f"chat has {len(messages)} messages; at most {MAX_CHAT_MESSAGES} are allowed")
    for number, message in enumerate(messages):
        if len(message.role) > MAX_ROLE_CHARS:
            raise InvalidArgument(
                f"chat message {number}: role is {len(message.role)} characters; at most {MAX_ROLE_CHARS}"
            )


def _check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stop)} stop strings sent; at most {MAX_STOP_STRINGS} are allowed")
    for text in stop:
        if not text or len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                f"a stop string must be 1-{MAX_STOP_STRING_CHARS} characters, got {len(text)}"
            )


def check_engine_limits(
    request: pb.GenerateRequest, max_tokens: int, model: str, limits: EngineLimits
) -> None:
    """INVALID_ARGUMENT, as the engine words it, for what the engine serving `model` would refuse:
    a chat to a model without a chat template, a chat role it does not accept, or a `max_tokens`
    (the request's, or the gateway's default) above its limit."""
    if request.WhichOneof("input") == "chat":
        if not limits.has_chat_template:
            raise InvalidArgument(f"model {model} has no chat template; send a plain prompt")
        _check_roles(request.chat.messages, limits.chat_roles)
    limit = limits.max_tokens_limit
    if limit is not None and max_tokens > limit:
        default = (
            "" if request.sampling.max_tokens else ", and is the gateway's default: the request gave none"
        )
        raise InvalidArgument(
            f"max_tokens {max_tokens} exceeds this engine's limit of {limit}{default}; "
            f"ask for at most {limit}"
        )


def _check_roles(messages: list[pb.ChatMessage], roles: tuple[str, ...]) -> None:
    if not roles:  # not reported: the engine checks
        return
    for number, message in enumerate(messages):
        if message.role not in roles:
            raise InvalidArgument(
                f"chat message {number}: role {message.role[:40]!r} is not one of {', '.join(roles)}"
            )


def check_sampling(sampling: pb.SamplingOptions) -> None:
    """INVALID_ARGUMENT, naming the range, when a sampling value lies outside its documented range."""
    t = sampling.temperature
    if not (t == 0.0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
        raise InvalidArgument(
            f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
            f"got {t:g}"
        )
    if not (math.isfinite(sampling.top_p) and 0.0 <= sampling.top_p <= 1.0):
        raise InvalidArgument(
            f"sampling.top_p must be in (0, 1] (0 or 1 turn it off), got {sampling.top_p:g}"
        )
    if sampling.top_k > MAX_TOP_K:
        raise InvalidArgument(
            f"sampling.top_k must be at most {MAX_TOP_K} (0 turns it off), got {sampling.top_k}"
        )
    if sampling.HasField("seed") and sampling.seed > MAX_SEED:
        raise InvalidArgument(f"sampling.seed must be at most {MAX_SEED}, got {sampling.seed}")
