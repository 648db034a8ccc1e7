"""Bounds on what a caller of the engine's API sends, checked before any work is done for it.

The gateway bounds what it passes on more tightly (docs/gateway_security.md); these hold for
direct callers too, and docs/engine_api.md lists them. Each refusal is INVALID_ARGUMENT and names
the limit; no refusal echoes more than a short cut of what it refuses.
"""

from __future__ import annotations

from services.common.errors import InvalidArgument
from thermocline.engine.v1 import engine_pb2 as pb

MAX_INTENT_CLASS_CHARS = 64  # class names are short; a longer one is refused before any lookup
# The salt goes into the hash of every full block of the prompt, on the step thread: a megabyte of it
# stalled every stream for a quarter of a second. The gateway sends the tenant id (128 at most).
MAX_CACHE_SALT_BYTES = 256
MAX_REQUEST_ID_CHARS = 256  # the gateway's x-request-id bound
# A chat is rendered by its template before its length can be checked: a million empty messages
# took seconds to render. The gateway's bound too.
MAX_CHAT_MESSAGES = 1024
# CountTokens counts text that need not fit the context (the gateway counts before the engine's
# context check), but not any amount: the gateway sends at most 1,000,000 bytes.
MAX_COUNT_CHARS = 1 << 20


def check_generate_bounds(request: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT when a field of a Generate request is over its bound."""
    if len(request.intent_class) > MAX_INTENT_CLASS_CHARS:
        raise InvalidArgument(
            f"intent_class {cut(request.intent_class)} has {len(request.intent_class):,} characters; "
            f"class names have at most {MAX_INTENT_CLASS_CHARS} (empty means the default class)"
        )
    salt = request.cache_salt  # UTF-8 has at least a byte a character: no need to encode a long one
    if len(salt) > MAX_CACHE_SALT_BYTES or len(salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(
            f"cache_salt has more than {MAX_CACHE_SALT_BYTES} UTF-8 bytes; send a short tenant id "
            "(or a digest of a longer one)"
        )
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request.request_id):,} characters; "
            f"at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    check_chat_bounds(request)


def check_chat_bounds(request: pb.GenerateRequest | pb.CountTokensRequest) -> None:
    """INVALID_ARGUMENT when a chat input has more messages than its bound."""
    if request.WhichOneof("input") == "chat" and len(request.chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(
            f"chat has {len(request.chat.messages):,} messages; at most {MAX_CHAT_MESSAGES} are allowed"
        )


def cut(value: str, max_chars: int = MAX_INTENT_CLASS_CHARS) -> str:
    """`value` quoted for a message, cut to `max_chars` characters."""
    return repr(value) if len(value) <= max_chars else f"{value[:max_chars]!r}..."


def check_count_bounds(request: pb.CountTokensRequest) -> None:
    """INVALID_ARGUMENT when a CountTokens input is over its bounds: the prompt, or the chat's roles
    and contents together, over MAX_COUNT_CHARS characters, or a chat of too many messages."""
    check_chat_bounds(request)
    if request.WhichOneof("input") == "chat":
        num_chars = sum(len(m.role) + len(m.content) for m in request.chat.messages)
    else:
        num_chars = len(request.prompt)
    if num_chars > MAX_COUNT_CHARS:
        raise InvalidArgument(
            f"CountTokens counts at most {MAX_COUNT_CHARS:,} characters (a prompt, or a chat's roles and "
            f"contents together); this input has {num_chars:,}"
        )
