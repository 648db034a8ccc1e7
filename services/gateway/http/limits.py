"""The HTTP front's connection limits, read from `THERMOCLINE_GATEWAY_HTTP_*` variables.

Every limit bounds what a client holds without a token: a connection, its fd, and the bytes of
a request head. Without them an idle connection, a head sent a byte at a time, or a body never
finished stayed open for good (slowloris), each holding one of the fds the gateway shares with
gRPC, Redis and the audit files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common import env
from services.gateway.request_bounds import MAX_TOKEN_CHARS

PREFIX = "THERMOCLINE_GATEWAY_HTTP_"
KIB = 1024
# The smallest head that carries the largest bearer token the gateway verifies, and a few headers.
MIN_HEADER_BYTES = MAX_TOKEN_CHARS + 4 * KIB


@dataclass(frozen=True)
class HttpLimits:
    """`_HEADER_TIMEOUT_S`: a request's line and headers must arrive within this many seconds of
    the connection opening, or of the previous answer on it, else the connection is closed.
    `_BODY_TIMEOUT_S`: a request's body must arrive within this many seconds of its head, else
    the call is answered 408 and the connection closed; the body is read only once the caller's
    token has verified.
    `_KEEP_ALIVE_S`: an idle connection between requests is closed after this (uvicorn's keep-alive).
    `_MAX_CONNECTIONS`: open connections (uvicorn's limit_concurrency). A new one that reaches it
    closes the connections that have waited longest for a request head, so that its own request
    can be served; one beyond it that finds every other connection in a request is closed at once;
    a request that arrives while this many are open or in progress is answered 503.
    `_MAX_AWAITING_HEAD_PER_IP`: connections from one client address waiting for a request head
    (before their first, or between requests); one more closes that address's oldest. A peer
    reopening idle sockets then holds no more than this many of the cap. Behind a proxy or NAT
    that brings many clients from one address, raise it to that address's share of connections.
    `_MAX_HEADER_BYTES`: the bytes of a request head held while it is incomplete (h11's
    incomplete-event limit; a head that grows past it is answered 400), room for a 16 KiB token as
    on gRPC. A complete head that arrives in one read (up to 256 KiB) is parsed whole.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_connections: int = 1024
    max_awaiting_head_per_ip: int = 64
    max_header_bytes: int = 32 * KIB

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0:
            raise ValueError(f"{PREFIX}HEADER_TIMEOUT_S must be > 0, got {self.header_timeout_s}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"{PREFIX}BODY_TIMEOUT_S must be > 0, got {self.body_timeout_s}")
        if self.keep_alive_s < 1:
            raise ValueError(f"{PREFIX}KEEP_ALIVE_S must be >= 1, got {self.keep_alive_s}")
        if self.max_connections < 1:
            raise ValueError(f"{PREFIX}MAX_CONNECTIONS must be >= 1, got {self.max_connections}")
        if self.max_awaiting_head_per_ip < 1:
            raise ValueError(
                f"{PREFIX}MAX_AWAITING_HEAD_PER_IP must be >= 1, got {self.max_awaiting_head_per_ip}"
            )
        if self.max_header_bytes < MIN_HEADER_BYTES:
            raise ValueError(
                f"{PREFIX}MAX_HEADER_BYTES must be at least {MIN_HEADER_BYTES} (the longest bearer "
                f"token and the other headers), got {self.max_header_bytes}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        """The limits the environment sets, the defaults for the rest."""
        return cls(
            header_timeout_s=env.get_float(PREFIX + "HEADER_TIMEOUT_S", cls.header_timeout_s, environ),
            body_timeout_s=env.get_float(PREFIX + "BODY_TIMEOUT_S", cls.body_timeout_s, environ),
            keep_alive_s=env.get_int(PREFIX + "KEEP_ALIVE_S", cls.keep_alive_s, environ),
            max_connections=env.get_int(PREFIX + "MAX_CONNECTIONS", cls.max_connections, environ),
            max_awaiting_head_per_ip=env.get_int(
                PREFIX + "MAX_AWAITING_HEAD_PER_IP", cls.max_awaiting_head_per_ip, environ
            ),
            max_header_bytes=env.get_int(PREFIX + "MAX_HEADER_BYTES", cls.max_header_bytes, environ),
        )
