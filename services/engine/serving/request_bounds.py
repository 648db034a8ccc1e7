"""Bounds on what a caller of the engine's API sends, checked before any work is done for it.

The gateway bounds what it passes on more tightly (docs/gateway_security.md); these hold for
direct callers too, and docs/engine_api.md lists them. Each refusal is INVALID_ARGUMENT and names
the limit; no refusal echoes more than a short cut of what it refuses.
"""

from __future__ import annotations

from services.common.errors import InvalidArgument
from thermocline.engine.v1 import engine_pb2 as pb

MAX_INTENT_CLASS_CHARS = 64  # class names are short; a longer one is refused before any lookup


def check_generate_bounds(request: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT when a field of a Generate request is over its bound."""
    if len(request.intent_class) > MAX_INTENT_CLASS_CHARS:
        raise InvalidArgument(
            f"intent_class {cut(request.intent_class)} has {len(request.intent_class):,} characters; "
            f"class names have at most {MAX_INTENT_CLASS_CHARS} (empty means the default class)"
        )


def cut(value: str, max_chars: int = MAX_INTENT_CLASS_CHARS) -> str:
    """`value` quoted for a message, cut to `max_chars` characters."""
    return repr(value) if len(value) <= max_chars else f"{value[:max_chars]!r}..."
