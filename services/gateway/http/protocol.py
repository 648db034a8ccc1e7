"""uvicorn's h11 protocol with the two connection limits uvicorn lacks, and CRLF-only heads.

uvicorn closes a connection only when it idles between requests (`timeout_keep_alive`, armed
after an answer), and `limit_concurrency` answers 503 to a request but never closes a connection
that sends none. So a connection that sends nothing, or a request head a byte at a time, stayed
open for good. Here every request head has a deadline, counted from the connection's start or
from the previous answer and not renewed by the bytes that dribble in. At `limit_concurrency` a
new connection closes the ones that have waited longest for their heads (awaiting_heads.py), and
each client host may keep only `max_awaiting_head_per_ip` connections waiting, its oldest closed
first: a peer that reopens idle sockets as fast as they are closed takes neither every slot nor
a real caller's. A connection in a request is never closed for another.

A client that stops reading an answer (a stream, or a body larger than the socket's buffers)
fills the transport's write buffer; its writes then wait for it for good, holding the
connection and, for a stream, the call. Once writing has been paused for `write_stall_s` (the
gateway's THERMOCLINE_GATEWAY_WRITE_STALL_S, which cuts a gRPC stream whose caller takes no
message), the connection is aborted: uvicorn sees it as lost, the pending write returns, and the
application hears `http.disconnect`, which cancels the call as a client that hangs up does.

h11 ends a head's lines at a bare LF as well as at CRLF; a proxy in front that splits lines only
at CRLF reads another set of headers, or another number of requests, from the same bytes
(request smuggling). A head with a bare LF is answered 400 and its connection closed before h11
parses it. The head is followed read by read (`HeadLineEndings`), and a head that arrived while
the previous request was served is checked from h11's buffer as its cycle starts.

A head h11 cannot parse (a malformed request line or header line, a bad Content-Length, a head
over the size limit) gets uvicorn's 400, whose body is here the front's JSON error object
(`code` "invalid_http") instead of uvicorn's plain text; uvicorn's warning for it is sampled
(sampled_log.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from services.gateway.http.awaiting_heads import AwaitingHeads
from services.gateway.http.errors import error_body
from services.gateway.http.metrics import WRITE_STALLS

log = logging.getLogger(__name__)

_BARE_LF = re.compile(rb"(?<!\r)\n")
_HEAD_END = b"\r\n\r\n"
_BARE_LF_REFUSAL = (
    "request head has a line that ends in a bare LF; end every line of the head with CRLF "
    "(RFC 9112 §2.2): proxies split such a head into other lines, which is how requests are smuggled"
)
_MALFORMED_REFUSAL = (
    "request is not valid HTTP/1.1: a malformed request line or header line, a bad Content-Length "
    "or Transfer-Encoding, or a head over {max_head_bytes} bytes; send a well-formed request"
)


class HeadLineEndings:
    """One request head's bytes, read by read up to its blank line: does a line end in a bare LF?

    Keeps the last three bytes read, so a CRLF or the blank line split across two reads is seen
    whole. The first CRLFCRLF ends the head: h11 ends it there or earlier, and earlier only at a
    bare LF, which this finds first. Bytes after the head (the body) are not looked at."""

    def __init__(self) -> None:
        self._tail = b""
        self.is_done = False  # the head's blank line has come

    def has_bare_lf(self, data: bytes) -> bool:
        """Whether `data`, the head's next bytes, holds a bare LF before the head's end."""
        if self.is_done or not data:
            return False
        start, window = len(self._tail), self._tail + data
        end = window.find(_HEAD_END)
        if end >= 0:
            self.is_done, window = True, window[: end + len(_HEAD_END)]
        self._tail = window[-3:]
        return _BARE_LF.search(window, start) is not None


class DeadlineConfig(uvicorn.Config):
    """uvicorn's settings plus the request head's deadline, the write-stall limit and the
    connections waiting for a head (shared by the server's connections), which
    `HeadDeadlineProtocol` reads."""

    def __init__(
        self,
        app: ASGIApp,
        header_timeout_s: float,
        write_stall_s: float,
        max_awaiting_head_per_ip: int,
        **settings: Any,
    ) -> None:
        super().__init__(app, http=HeadDeadlineProtocol, **settings)
        self.header_timeout_s = header_timeout_s
        self.write_stall_s = write_stall_s
        self.awaiting_heads: AwaitingHeads[HeadDeadlineProtocol] = AwaitingHeads(max_awaiting_head_per_ip)


class HeadDeadlineProtocol(H11Protocol):
    """h11 over one connection: a request head that is late closes it, and so does a newer
    connection while this one waits for its head at the connection cap or past its host's cap.
    The deadline runs while h11 waits for a head (its peer is IDLE); the body's deadline is the
    application's (intake.py)."""

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
        self.awaiting_heads = config.awaiting_heads
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_endings: HeadLineEndings | None = None  # of the head h11 awaits
        self.write_stall_s = config.write_stall_s
        self._write_stall: asyncio.TimerHandle | None = None  # armed while writing is paused
        self.max_head_bytes = config.h11_max_incomplete_event_size

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_head()
        self._make_room()

    def _make_room(self) -> None:
        """Closes the connections that have waited longest for a head until a request on this one
        would be served (uvicorn answers 503 to one that arrives with `limit_concurrency` open),
        or closes this one when every other is in a request and the cap is passed."""
        if self.limit_concurrency is None:
            return
        while len(self.connections) >= self.limit_concurrency:
            oldest = self.awaiting_heads.oldest(other_than=self)
            if oldest is None:
                break
            oldest.close_awaiting_head()
        if len(self.connections) > self.limit_concurrency:
            self.close_awaiting_head()  # over the cap: the fd goes back at once

    def close_awaiting_head(self) -> None:
        """Closes this connection, which waits for a head, and frees its slot at once."""
        self.connections.discard(self)  # uvicorn's count, before connection_lost comes
        self._disarm()
        self.timeout_keep_alive_handler()  # closes as uvicorn closes an idle connection

    def data_received(self, data: bytes) -> None:
        if self._has_bare_lf(data):
            self._refuse_bare_lf()
            return
        super().data_received(data)
        self._follow_head()

    def handle_events(self) -> None:
        if self._has_bare_lf(b""):  # a pipelined head, as its cycle starts
            self._refuse_bare_lf()
            return
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._head_endings = None  # the head is in; the next one is followed afresh

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_write_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.write_stall_s, self._write_has_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._end_write_stall()

    def _end_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_has_stalled(self) -> None:
        """The client read nothing for `write_stall_s`: abort, so no fd waits on it to drain."""
        self._write_stall = None
        WRITE_STALLS.inc()
        log.warning(
            "HTTP client %s read none of its answer for %g s (THERMOCLINE_GATEWAY_WRITE_STALL_S); "
            "connection aborted",
            self.client,
            self.write_stall_s,
        )
        self.transport.abort()

    def _follow_head(self) -> None:
        """Arms the deadline once h11 waits for a request head; disarms it once the head is in."""
        is_awaiting_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not is_awaiting_head:
            self._disarm()
        elif self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_is_late)
            self._await_head()

    def _await_head(self) -> None:
        """Counts this connection as waiting for a head; its host's oldest goes past the host's cap."""
        host = self.client[0] if self.client else ""
        self.awaiting_heads.add(self, host)
        if (oldest := self.awaiting_heads.oldest_over_host_cap(host)) is not None:
            oldest.close_awaiting_head()

    def _has_bare_lf(self, data: bytes) -> bool:
        """Whether the head h11 awaits, with `data` (not yet given to h11), has a bare LF."""
        if self.conn.their_state is not h11.IDLE:
            self._head_endings = None
            return False
        if self._head_endings is None:  # a new head: h11 may hold some of it, sent while the last was served
            self._head_endings = HeadLineEndings()
            data = self.conn.trailing_data[0] + data
        return self._head_endings.has_bare_lf(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 cannot parse (`msg` is uvicorn's plain text for it), as
        the front's JSON error object; the connection is closed."""
        self._refuse(_MALFORMED_REFUSAL.format(max_head_bytes=self.max_head_bytes), "invalid_http")

    def _refuse_bare_lf(self) -> None:
        self._refuse(_BARE_LF_REFUSAL, "bare_lf")

    def _refuse(self, message: str, code: str) -> None:
        """400 with the reason, then the connection is closed: nothing after the head is read."""
        body = json.dumps(error_body(400, message, code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(
            self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
        )
        self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
        self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        self.transport.close()
        self._disarm()

    def _disarm(self) -> None:
        self.awaiting_heads.discard(self)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_is_late(self) -> None:
        self._head_deadline = None
        self.close_awaiting_head()
