"""The HTTP front's calls in flight, counted for the process's drain.

The drain (services/common/server.py) waits for the calls in flight until the grace period ends,
then cuts the Generate streams left, which are both fronts' (services/gateway/in_flight.py), and
waits up to CUT_WAIT_S for them to end with the status that says so. The gRPC server's calls are
counted by its interceptor; this middleware counts the HTTP front's, in a tracker the drain waits
on as well (ServiceSpec.other_calls). Without it, a drain with no gRPC call in flight stopped at
once and left the HTTP streams to uvicorn's shutdown, which cancelled them at the end of a grace of
its own: the client saw the stream break off, and no stream.cut was audited.

A call counts from its request until the application has handed uvicorn its answer's last bytes
(a cut stream's error event among them); what is left in the connection's buffer for a client
reading slowly gets uvicorn's own, short, close wait (server.py).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.interceptors import CallTracker


class CountInFlight:
    """ASGI middleware: each HTTP request is in flight in `calls` until the application returns."""

    def __init__(self, app: ASGIApp, calls: CallTracker) -> None:
        self.app = app
        self.calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.calls.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.calls.exit()
