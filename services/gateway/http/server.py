"""uvicorn serving the HTTP front inside the gateway process's event loop.

One loop serves both fronts, so they share the servicer, its stream slots and every policy
object without locks. The gRPC runner owns SIGTERM: uvicorn must not install its own handlers
(it would swallow the signal that starts the drain). The drain counts HTTP calls with gRPC ones
(in_flight.py): they get the same grace period, and the streams left then are cut, audited and
waited for alike. uvicorn stops when the gateway closes, after the drain: its connections then get
CLOSE_WAIT_S to take what was written to them (a client reading the end of an answer slowly), and
whatever is still running is cancelled. Connections are bounded by `HttpLimits` (limits.py): a
head deadline, a connection cap and a cap per client host on connections waiting for a head
(protocol.py), keep-alive, head size. uvicorn's warning for each request it refuses itself (a
malformed head, one past the connection cap) is logged at most once a minute, with a count
(sampled_log.py), so a client cannot flood the log.
A client that reads none of its answer for the gateway's write-stall limit, which the app
carries (`WRITE_STALL_STATE`, set by app.py from GatewayConfig), loses its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from services.gateway.http.limits import HttpLimits
from services.gateway.http.protocol import DeadlineConfig
from services.gateway.http.sampled_log import UVICORN_LOGGER, SampledLog

log = logging.getLogger(__name__)
WRITE_STALL_STATE = "write_stall_s"  # the app's state key for THERMOCLINE_GATEWAY_WRITE_STALL_S
# How long uvicorn's shutdown, which comes after the drain, waits for its connections to close.
CLOSE_WAIT_S = 1


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process that embeds it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds the port at start (so a taken port fails the gateway's start-up), serves until stop."""

    def __init__(self, app: Starlette, host: str, port: int, limits: HttpLimits) -> None:
        config = DeadlineConfig(
            app,
            header_timeout_s=limits.header_timeout_s,
            write_stall_s=getattr(app.state, WRITE_STALL_STATE),
            max_awaiting_head_per_ip=limits.max_awaiting_head_per_ip,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=CLOSE_WAIT_S,
            timeout_keep_alive=limits.keep_alive_s,
            limit_concurrency=limits.max_connections,
            h11_max_incomplete_event_size=limits.max_header_bytes,
        )
        self._server = _EmbeddedServer(config)
        self.host, self.port = host, port
        self._task: asyncio.Task[None] | None = None
        self._sampled_log = SampledLog()

    async def start(self) -> None:
        """Listens on host:port and starts serving."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as error:
            sock.close()
            raise OSError(
                f"gateway HTTP front: cannot bind {self.host}:{self.port} ({error}); is the port taken?"
            ) from None
        sock.listen(1024)
        sock.setblocking(False)
        logging.getLogger(UVICORN_LOGGER).addFilter(self._sampled_log)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        log.info("OpenAI-compatible HTTP front on http://%s:%d/v1", self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, closes the connections (each once what was written to it is sent, within
        CLOSE_WAIT_S), cancels any call still running, then returns."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        logging.getLogger(UVICORN_LOGGER).removeFilter(self._sampled_log)
