"""Stop strings: find them in streamed text, and hold back text that might be the start of one."""

from __future__ import annotations

from typing import NamedTuple


class StopCheck(NamedTuple):
    """Text that is safe to emit now, and whether a stop string ended the sequence."""

    text: str
    is_stopped: bool


class StopChecker:
    """Accumulates completion text and releases it only when it cannot be part of a stop string.

    The stop string itself is never emitted. Text is held back while its tail is a prefix of some
    stop string, so a client never sees text that a later token would retract.
    """

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._pending = ""

    @property
    def is_active(self) -> bool:
        """There are stop strings to look for (without any, `push` returns its text as it came)."""
        return bool(self._stops)

    def push(self, delta: str) -> StopCheck:
        """Add newly decoded text; return what may be emitted now."""
        if not self._stops:
            return StopCheck(delta, is_stopped=False)
        self._pending += delta
        cut = self._first_stop_index()
        if cut is not None:
            text, self._pending = self._pending[:cut], ""
            return StopCheck(text, is_stopped=True)
        keep = self._held_suffix_len()
        text = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return StopCheck(text, is_stopped=False)

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _first_stop_index(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _held_suffix_len(self) -> int:
        # longest tail of pending text that is a proper prefix of a stop string
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
