"""HTTP/1.1 framing rules that h11 leaves to the application.

A request with both Content-Length and Transfer-Encoding is how requests are smuggled past a
proxy that frames by the other header. h11 frames it by Transfer-Encoding, as RFC 9112 §6.1
allows, and keeps the connection open, so whatever follows the chunked body is read as a second
request. §6.1 also says that a server which takes such a request MUST close the connection after
answering it; this front refuses it outright, 400 with `Connection: close`, before any route runs.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.http.errors import error_body

CLOSE = {"Connection": "close"}
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
