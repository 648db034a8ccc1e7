"""What one check computes more than once, kept until the check ends.

A chat's check reads the same text several times: the classifier reads the views of its turns (or
of packs of them, chat.packed_turns), of its joins and of the whole conversation, and the deny
patterns read the views of its turns, joins and whole again; and a turn is a line of a pack and
the tail of a "role: content" line of the whole, which the line decoders (decoders.hidden_texts)
read one by one. Views and decoded lines are functions of their text alone, so each is computed
once per check and read back after. normalizer.py's own cache keeps the views of the last 64 short
texts, which a chat of hundreds of turns or a whole conversation past 20,000 characters outgrows:
a check of 600 short messages computed its whole conversation's views twice and its turns' lines
five times.

A context variable, as in cancellation.py: Screen.check opens one cache for its stages, and a
caller outside a check (training, tools that call the classifier alone, tests of one decoder)
keeps nothing past normalizer.py's own cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
# Decoded lines kept per check: a turn's line takes one per line decoder (about a dozen), so a chat
# of 1,000 turns and its whole fit; a prompt of many thousand lines stops adding past it (about
# 10 MB of keys and results), and its lines are decoded as they come, as before.
MAX_DECODED_LINES = 65_536


class CheckCache:
    """The views and decoded lines of one check's texts; `views` and `decoded_line` add to it."""

    def __init__(self) -> None:
        self._views: dict[str, Any] = {}
        self._lines: dict[tuple[Callable[[str], str | None], str], str | None] = {}

    def views(self, text: str, compute: Callable[[str], T]) -> T:
        """compute(text), computed the first time this check asks for `text`'s views."""
        if text not in self._views:
            self._views[text] = compute(text)
        return self._views[text]  # type: ignore[no-any-return]

    def decoded_line(self, decoder: Callable[[str], str | None], line: str) -> str | None:
        """decoder(line), computed the first time this check decodes `line` so (while fewer than
        MAX_DECODED_LINES are kept)."""
        key = (decoder, line)
        if key in self._lines:
            return self._lines[key]
        decoded = decoder(line)
        if len(self._lines) < MAX_DECODED_LINES:
            self._lines[key] = decoded
        return decoded


_CACHE: ContextVar[CheckCache | None] = ContextVar("safety_check_cache", default=None)


@contextmanager
def remembering() -> Iterator[None]:
    """Keeps what the check running in this context computes until the block ends; inside another
    such block, the outer one's cache serves."""
    if _CACHE.get() is not None:
        yield
        return
    token = _CACHE.set(CheckCache())
    try:
        yield
    finally:
        _CACHE.reset(token)


def current() -> CheckCache | None:
    """The cache of the check running in this context; None outside one."""
    return _CACHE.get()
