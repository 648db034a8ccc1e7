"""HTTP/1.1 framing rules that h11 leaves to the application.

A request with both Content-Length and Transfer-Encoding is how requests are smuggled past a
proxy that frames by the other header. h11 frames it by Transfer-Encoding, as RFC 9112 §6.1
allows, and keeps the connection open, so whatever follows the chunked body is read as a second
request. §6.1 also says that a server which takes such a request MUST close the connection after
answering it; this front refuses it outright, 400 with `Connection: close`, before any route runs.

An answer sent before its request's body was read to the end (a refusal made from the headers:
a bad token, a declared size over the limit, a late body, an unknown path) closes the
connection. Kept open, h11 would go on reading and dropping the rest of that body for as long
as the client takes to send it, with no deadline, and only then read the next request.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.http.errors import error_body

CLOSE = {"Connection": "close"}
_CLOSE_HEADER = (b"connection", b"close")
_AMBIGUOUS = (
    "request carries both Content-Length and Transfer-Encoding, which proxies may frame differently "
    "(RFC 9112 §6.1); send exactly one of them"
)


class RefuseAmbiguousFraming:
    """ASGI middleware: a request framed by both Content-Length and Transfer-Encoding gets 400 and
    its connection is closed, so no bytes after it are read as another request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_ambiguous(Headers(scope=scope)):
            refusal = JSONResponse(error_body(400, _AMBIGUOUS, "ambiguous_framing"), 400, headers=CLOSE)
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _is_ambiguous(headers: Headers) -> bool:
    return "content-length" in headers and "transfer-encoding" in headers


class CloseAfterUnreadBody:
    """ASGI middleware: an answer that starts before its request's body was read to the end
    carries `Connection: close`, so h11 closes the connection once it is sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        is_read = False

        async def receive_noting_the_end() -> Message:
            nonlocal is_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                is_read = True
            return message

        async def send_closing_if_unread(message: Message) -> None:
            if message["type"] == "http.response.start" and not is_read:
                message = {**message, "headers": [*message.get("headers", []), _CLOSE_HEADER]}
            await send(message)

        await self.app(scope, receive_noting_the_end, send_closing_if_unread)


def _has_body(headers: Headers) -> bool:
    """Whether the request's framing says a body follows (h11 has checked Content-Length's digits)."""
    return "transfer-encoding" in headers or int(headers.get("content-length", "0")) > 0
