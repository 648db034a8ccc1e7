"""The write-stall limit against a real uvicorn server and a real socket: a client that reads none of
a streamed answer loses its connection, and the stream is cancelled, after the limit; a client
that reads is served to the end. The app is a tiny endless stream, so the client's buffers fill
whatever the model's context length."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from services.cli.mesh import free_port
from services.gateway.http.limits import HttpLimits
from services.gateway.http.metrics import WRITE_STALLS
from services.gateway.http.server import WRITE_STALL_STATE, HttpServer

WRITE_STALL_S = 0.5
CHUNK = b"data: " + b"x" * 1000 + b"\n\n"
STREAM = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"


class EndlessStream:
    """An app that streams until it is cancelled, and says when it ended."""

    def __init__(self, num_chunks: int | None = None) -> None:
        self.num_chunks = num_chunks
        self.has_ended = asyncio.Event()

    def app(self) -> Starlette:
        app = Starlette(routes=[Route("/stream", self.stream)])
        setattr(app.state, WRITE_STALL_STATE, WRITE_STALL_S)
        return app

    async def stream(self, request: Request) -> StreamingResponse:
        return StreamingResponse(self.chunks())

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            num_sent = 0
            while self.num_chunks is None or num_sent < self.num_chunks:
                yield CHUNK
                num_sent += 1
                await asyncio.sleep(0)  # a source that awaits (the engine's queue) lets the loop run
        finally:
            self.has_ended.set()


async def _serve(stream: EndlessStream) -> tuple[HttpServer, int]:
    port = free_port()
    server = HttpServer(stream.app(), "127.0.0.1", port, limits=HttpLimits())
    await server.start()
    return server, port


async def _client(port: int) -> socket.socket:
    """A socket with a small receive buffer, so that an unread answer fills it soon."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    return client


async def _read_until_closed(client: socket.socket) -> int:
    """Reads what the server sent until it closes the connection; the bytes read."""
    num_bytes = 0
    try:
        while chunk := await asyncio.get_running_loop().sock_recv(client, 1 << 20):
            num_bytes += len(chunk)
    except ConnectionResetError:  # aborted: the rest of its buffer was dropped
        pass
    return num_bytes


def test_a_client_that_reads_nothing_loses_its_connection_and_its_stream() -> None:
    async def run() -> None:
        stream = EndlessStream()
        server, port = await _serve(stream)
        num_stalls = WRITE_STALLS._value.get()
        with await _client(port) as client:
            await asyncio.get_running_loop().sock_sendall(client, STREAM)
            await asyncio.wait_for(stream.has_ended.wait(), 40 * WRITE_STALL_S)  # nothing read
            assert WRITE_STALLS._value.get() == num_stalls + 1
            await asyncio.wait_for(_read_until_closed(client), 10)
        await server.stop()

    asyncio.run(run())


def test_a_client_that_reads_gets_the_whole_stream() -> None:
    async def run() -> None:
        stream = EndlessStream(num_chunks=2000)  # 2 MB, past every buffer on the way
        server, port = await _serve(stream)
        num_stalls = WRITE_STALLS._value.get()
        with await _client(port) as client:
            await asyncio.get_running_loop().sock_sendall(
                client, STREAM.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
            )
            assert await asyncio.wait_for(_read_until_closed(client), 30) > 2000 * len(CHUNK)
        assert WRITE_STALLS._value.get() == num_stalls
        await server.stop()

    asyncio.run(run())
