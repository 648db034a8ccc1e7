"""Framing against the real HTTP front: a request framed two ways is refused and its connection
closed, so the request hidden behind it is never read; so is the connection of a request
answered before its body was read, whose client could otherwise dribble that body for good."""

from __future__ import annotations

import json

import pytest

from services.gateway.http.protocol import HeadLineEndings
from tests.http.conftest import HttpGateway

HIDDEN = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
MALFORMED = {
    "request-line": b"GET /health\r\nHost: x\r\n\r\n",
    "header-without-colon": b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    "content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n{}",
}
MALFORMED_LOG_LINE = "Invalid HTTP request received"


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    http_gateway: HttpGateway,
) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n"
    exchange = http_gateway.exchange(head + b"\r\n0\r\n\r\n" + HIDDEN)
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"], exchange.received
    assert b"connection: close" in exchange.received.lower() and b"RFC 9112" in exchange.received
    assert exchange.is_closed


def test_a_plainly_framed_request_keeps_its_connection(http_gateway: HttpGateway) -> None:
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    exchange = http_gateway.exchange(
        health + health + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert exchange.status_lines == ["HTTP/1.1 200 OK"] * 3 and exchange.is_closed


def test_an_answer_sent_before_the_body_is_read_closes_the_connection(http_gateway: HttpGateway) -> None:
    head = b"POST /v1/no-such-path HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    exchange = http_gateway.exchange(head + b'{"prompt": "')
    assert exchange.status_lines == ["HTTP/1.1 404 Not Found"], exchange.received
    assert b"connection: close" in exchange.received.lower() and exchange.is_closed


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\nHost: x\n\n",
        b"GET /health HTTP/1.1\r\nHost: x\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n\n",
        b"\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["every-line", "one-header", "blank-line", "before-the-request-line"],
)
def test_a_head_with_a_bare_lf_is_refused_and_the_connection_closed(
    http_gateway: HttpGateway, request_bytes: bytes
) -> None:
    exchange = http_gateway.exchange(request_bytes + HIDDEN)
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"], exchange.received
    assert b"bare LF" in exchange.received and exchange.is_closed


def test_a_bare_lf_in_a_pipelined_head_is_refused_after_the_request_before_it(
    http_gateway: HttpGateway,
) -> None:
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    exchange = http_gateway.exchange(health + b"GET /health HTTP/1.1\r\nHost: x\n\n" + HIDDEN)
    assert exchange.status_lines == ["HTTP/1.1 200 OK", "HTTP/1.1 400 Bad Request"], exchange.received
    assert exchange.is_closed


@pytest.mark.parametrize(
    ("pieces", "is_bare"),
    [
        ([b"GET / HTTP/1.1\r", b"\nHost: x\r", b"\n\r", b"\n"], False),
        ([b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody\nwith\nbare\nLFs"], False),
        ([b"GET / HTTP/1.1\r\nHost: x\r\n\r", b"\nbody\n"], False),
        ([b"GET / HTTP/1.1\r\nHost: x", b"\n\r\n"], True),
        ([b"GET / HTTP/1.1\r\n", b"\n"], True),
        ([b"\n"], True),
    ],
    ids=[
        "crlf-split",
        "lf-in-body",
        "end-split-before-body",
        "lf-at-a-read-start",
        "lf-blank-line",
        "lf-alone",
    ],
)
def test_line_endings_are_followed_across_reads(pieces: list[bytes], is_bare: bool) -> None:
    endings = HeadLineEndings()
    assert any([endings.has_bare_lf(piece) for piece in pieces]) is is_bare


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_framing_is_a_400_in_the_fronts_error_shape(
    http_gateway: HttpGateway, request_bytes: bytes
) -> None:
    exchange = http_gateway.exchange(request_bytes + HIDDEN)
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"], exchange.received
    head, _, body = exchange.received.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower() and exchange.is_closed
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http")
    assert "not valid HTTP/1.1" in error["message"]


def test_a_flood_of_malformed_requests_logs_one_line_a_minute(http_gateway: HttpGateway) -> None:
    before = http_gateway.log().count(MALFORMED_LOG_LINE)
    for _ in range(10):
        for request_bytes in MALFORMED.values():
            assert http_gateway.exchange(request_bytes).status_lines == ["HTTP/1.1 400 Bad Request"]
    logged = http_gateway.log().count(MALFORMED_LOG_LINE)
    # uvicorn logs before it answers: the first of the run is in the log, and 30 more add one line
    # at most (one when the last was logged a minute or more ago)
    assert logged >= 1 and logged - before <= 1, f"{logged - before} lines for 30 malformed requests"
