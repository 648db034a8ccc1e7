"""The HTTP front's request counter: the HTTP twin of `thermocline_rpc_server_handled_total`.

Autoscaling and dashboards count the gateway's load from both fronts; without this, a gateway busy
with OpenAI-compatible calls looked idle to KEDA. Routes outside the served set count as "other",
so a scan of random paths cannot grow the label set.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HTTP_HANDLED = Counter(
    "thermocline_gateway_http_requests_total",
    "HTTP requests the OpenAI-compatible front answered, by route and status code.",
    ["route", "code"],
)
WRITE_STALLS = Counter(
    "thermocline_gateway_http_write_stalls_total",
    "HTTP connections aborted because the client read none of its answer for the write-stall limit.",
)
OTHER_ROUTE = "other"


class CountRequests:
    """ASGI middleware: counts each finished HTTP request by route and the status it was answered with
    (500 if it ended before answering). A stream counts when it ends. The count is taken before the
    last body chunk goes out, so a client that has read the whole answer finds it counted."""

    def __init__(self, app: ASGIApp, routes: Collection[str]) -> None:
        self.app = app
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else OTHER_ROUTE
        status, counted = 500, False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                HTTP_HANDLED.labels(route, str(status)).inc()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                count()
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            count()  # ended before its last chunk (or before answering: 500)
