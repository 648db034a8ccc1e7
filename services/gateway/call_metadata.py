"""A call's metadata as the gatekeeper reads it: text entries, with repeated keys kept visible,
and the call's ids: the gateway's own request id, and the one the caller sent, kept apart."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

CLIENT_REQUEST_ID_KEY = "x-request-id"
MAX_CLIENT_REQUEST_ID_CHARS = 128


def new_request_id() -> str:
    """A call's id in the gateway's audit events, its span and its engine request. The gateway
    makes it: a caller's id could name another caller's request, or repeat one of its own."""
    return uuid.uuid4().hex


def client_request_id_of(value: str) -> str:
    """The caller's own request id as the audit log records it (`details.client_request_id`): cut
    to MAX_CLIENT_REQUEST_ID_CHARS, and "" when it holds a non-printable character."""
    given = value[:MAX_CLIENT_REQUEST_ID_CHARS]
    return given if given.isprintable() else ""


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

    @property
    def client_request_id(self) -> str:
        """The caller's `x-request-id`, as the audit log records it ("" when none was sent)."""
        return client_request_id_of(self.get(CLIENT_REQUEST_ID_KEY, ""))

    def get_all(self, key: str) -> list[str]:
        """Every value sent under `key`, in order."""
        return [value for name, value in self._pairs if name == key]

    def __getitem__(self, key: str) -> str:
        return self._first[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)
