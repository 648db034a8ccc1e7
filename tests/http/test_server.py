"""The HTTP front's connection limits against real sockets: a connection that sends no request
head in time is closed, however slowly its bytes come; at the cap the oldest connection waiting
for a head makes room for a new one, and one host keeps only so many waiting; a head with the
longest token the gateway verifies still fits."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from services.cli.mesh import Mesh
from services.gateway.request_bounds import MAX_TOKEN_CHARS
from tests.http.conftest import (
    STRICT_TIMEOUT_S,
    Exchange,
    HttpGateway,
    http_replica,
    read_until_closed,
)

MAX_CONNECTIONS = 4
MAX_AWAITING_HEAD_PER_IP = 3
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
CLOSE_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
COMPLETION = b'{"prompt": "Once", "max_tokens": 1, "temperature": 0.0}'
# What uvicorn let h11 hold of an incomplete head before THERMOCLINE_GATEWAY_HTTP_MAX_HEADER_BYTES.
H11_DEFAULT_HEAD_BYTES = 16 * 1024


def test_a_connection_that_sends_nothing_is_closed(strict_gateway: HttpGateway) -> None:
    exchange = strict_gateway.exchange(b"")
    assert exchange.is_closed and not exchange.received


def test_a_head_that_never_ends_is_closed_however_often_a_byte_comes(strict_gateway: HttpGateway) -> None:
    started = time.monotonic()
    with socket.create_connection(strict_gateway.address, timeout=0.2) as connection:
        connection.sendall(PARTIAL_HEAD)
        is_closed = False
        while not is_closed and time.monotonic() - started < 20 * STRICT_TIMEOUT_S:
            is_closed = _dribble(connection, b"X-Slow: 1\r\n")
    assert is_closed, "a head dribbled in five times a second kept its connection"


def _dribble(connection: socket.socket, line: bytes) -> bool:
    """Sends one more header line, then waits up to the socket's timeout; True once it is closed."""
    try:
        connection.sendall(line)
        return connection.recv(1024) == b""
    except TimeoutError:
        return False
    except (BrokenPipeError, ConnectionResetError):
        return True


def test_a_kept_alive_connection_gets_a_deadline_for_its_next_head(strict_gateway: HttpGateway) -> None:
    # uvicorn's keep-alive timer covers the idle time after an answer, but the first byte of
    # the next request disarms it
    with socket.create_connection(strict_gateway.address, timeout=10) as connection:
        connection.sendall(HEALTH)
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += connection.recv(1024)
        connection.sendall(PARTIAL_HEAD)
        exchange = read_until_closed(connection)
    assert exchange.is_closed and not exchange.received


def test_idle_connections_at_the_cap_make_room_for_a_request(
    open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # a peer that held every slot with sockets that send nothing locked every caller out: the
    # new connection was the one closed. Now the oldest idle one goes, never one in a request.
    settings = {"THERMOCLINE_GATEWAY_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with (
        http_replica(open_mesh, tmp_path_factory, "gateway-http-capped", **settings) as gateway,
        contextlib.ExitStack() as held,
    ):
        in_request = held.enter_context(_connect(gateway))
        _start_request(in_request, gateway.user_token)
        idle = [held.enter_context(_connect(gateway)) for _ in range(MAX_CONNECTIONS + 2)]
        assert gateway.call("GET", "/models").status == 200
        assert read_until_closed(idle[0]) == Exchange(b"", is_closed=True)  # the oldest made room
        in_request.sendall(COMPLETION)
        assert read_until_closed(in_request).status_lines == ["HTTP/1.1 200 OK"]


def test_one_host_keeps_only_its_cap_of_connections_waiting_for_a_head(
    open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = {
        "THERMOCLINE_GATEWAY_HTTP_MAX_AWAITING_HEAD_PER_IP": str(MAX_AWAITING_HEAD_PER_IP),
        "THERMOCLINE_GATEWAY_HTTP_HEADER_TIMEOUT_S": "600",  # no head deadline closes them
    }
    with (
        http_replica(open_mesh, tmp_path_factory, "gateway-http-per-ip", **settings) as gateway,
        contextlib.ExitStack() as held,
    ):
        idle = [held.enter_context(_connect(gateway)) for _ in range(MAX_AWAITING_HEAD_PER_IP + 2)]
        for oldest in idle[:2]:
            assert read_until_closed(oldest) == Exchange(b"", is_closed=True)
        for newest in idle[2:]:
            newest.sendall(CLOSE_HEALTH)
            assert read_until_closed(newest).status_lines == ["HTTP/1.1 200 OK"]


def _connect(gateway: HttpGateway) -> socket.socket:
    """A connection to the front that has sent nothing yet."""
    return socket.create_connection(gateway.address, timeout=10)


def _start_request(connection: socket.socket, token: str) -> None:
    """Sends the head of a COMPLETION and returns once the front reads its body: the connection
    is then in a request (uvicorn sends 100 Continue on the app's first read)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"X-Intent: chat\r\nContent-Length: {len(COMPLETION)}\r\nConnection: close\r\n"
        "Expect: 100-continue\r\n\r\n"
    )
    connection.sendall(head.encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += connection.recv(1024)
    assert answer.startswith(b"HTTP/1.1 100 Continue"), answer


def test_a_head_with_the_longest_token_fits_when_it_comes_in_pieces(http_gateway: HttpGateway) -> None:
    token = _token_of_about(http_gateway, MAX_TOKEN_CHARS - 64)
    assert MAX_TOKEN_CHARS - 256 < len(token) <= MAX_TOKEN_CHARS
    head = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n"
    assert len(head) > H11_DEFAULT_HEAD_BYTES
    with socket.create_connection(http_gateway.address, timeout=10) as connection:
        connection.sendall(head.encode())  # all but the blank line: h11 holds an incomplete head
        # the front has read those bytes by the time it answers a connection opened after them
        assert http_gateway.exchange(HEALTH + CLOSE_HEALTH).status_lines == ["HTTP/1.1 200 OK"] * 2
        connection.sendall(b"\r\n")
        exchange = read_until_closed(connection)
    assert exchange.status_lines == ["HTTP/1.1 200 OK"], exchange.received[:300]


def test_an_unfinished_head_over_the_limit_is_refused(http_gateway: HttpGateway) -> None:
    # h11 bounds the bytes it holds for an event not yet complete; a finished head read in one go
    # is parsed whole, so this head never ends
    exchange = http_gateway.exchange(PARTIAL_HEAD + b"X-Big: " + b"a" * (64 * 1024))
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"] and exchange.is_closed


def _token_of_about(gateway: HttpGateway, num_chars: int) -> str:
    """A valid user token padded with a claim to about `num_chars` characters."""
    bare = gateway.token(roles=["user"])
    return gateway.token(roles=["user"], pad="p" * ((num_chars - len(bare)) * 3 // 4))
