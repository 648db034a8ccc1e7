"""uvicorn's h11 protocol with the two connection limits uvicorn lacks.

uvicorn closes a connection only when it idles between requests (`timeout_keep_alive`, armed
after an answer), and `limit_concurrency` answers 503 to a request but never closes a connection
that sends none. So a connection that sends nothing, or a request head a byte at a time, stayed
open for good. Here every request head has a deadline, counted from the connection's start or
from the previous answer and not renewed by the bytes that dribble in, and a connection beyond
`limit_concurrency` is closed as it opens.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState


class DeadlineConfig(uvicorn.Config):
    """uvicorn's settings plus the request head's deadline, which `HeadDeadlineProtocol` reads."""

    def __init__(self, app: ASGIApp, header_timeout_s: float, **settings: Any) -> None:
        super().__init__(app, http=HeadDeadlineProtocol, **settings)
        self.header_timeout_s = header_timeout_s


class HeadDeadlineProtocol(H11Protocol):
    """h11 over one connection: a request head that is late closes it, and so does opening it
    while `limit_concurrency` connections are open. The deadline runs while h11 waits for a head
    (its peer is IDLE); the body's deadline is the application's (intake.py)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, DeadlineConfig)
        self.header_timeout_s = config.header_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            transport.close()  # over the cap: the fd goes back at once
            return
        self._follow_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_head(self) -> None:
        """Arms the deadline once h11 waits for a request head; disarms it once the head is in."""
        is_awaiting_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not is_awaiting_head:
            self._disarm()
        elif self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_is_late)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_is_late(self) -> None:
        self._head_deadline = None
        self.timeout_keep_alive_handler()  # closes as uvicorn closes an idle connection
