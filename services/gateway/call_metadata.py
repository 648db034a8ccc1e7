"""A call's metadata as the gatekeeper reads it: text entries, with repeated keys kept visible."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class CallMetadata(Mapping[str, str]):
    """The text (non-`-bin`) entries of a call: the first value per key, and every value on request.

    A plain dict would keep only one of two `authorization` entries, so a caller could smuggle a
    second credential past a proxy that checked the first; `get_all` lets the gatekeeper refuse that.
    """

    def __init__(self, pairs: Iterable[tuple[str, Any]]) -> None:
        self._pairs = [(key, value) for key, value in pairs if isinstance(value, str)]
        self._first: dict[str, str] = {}
        for key, value in self._pairs:
            self._first.setdefault(key, value)

    @classmethod
    def of(cls, context: Any) -> CallMetadata:
        """The metadata of a servicer context."""
        return cls(context.invocation_metadata() or ())

    def get_all(self, key: str) -> list[str]:
        """Every value sent under `key`, in order."""
        return [value for name, value in self._pairs if name == key]

    def __getitem__(self, key: str) -> str:
        return self._first[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)
