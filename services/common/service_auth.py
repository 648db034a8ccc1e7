"""Service-to-service authentication: the token that every call between the mesh's services carries.

Only the gateway authenticates users. The internal services (engine, kvstore, safety) take the
tenant, the namespace and the request settings from their caller, so whoever reaches their ports
could read, poison or delete any tenant's prefix blocks, or generate past the gateway's JWT, RBAC,
rate limits and audit. Each internal call therefore carries a secret the mesh's services share,
read from the file `THERMOCLINE_SERVICE_TOKEN_FILE` names, in the `x-thermocline-service-token`
metadata entry; an internal server refuses a call without it with UNAUTHENTICATED.

Health checks and reflection stay open (compose and k8s probes call them without a token), and
so does /metrics (HTTP). The gateway's public port checks JWTs, not this token.

Without the setting an internal service listening on loopback only (tests, `thermocline up`)
serves anyone who can reach it, with one warning; one listening on any other address refuses to
start: on a network the token is what keeps a neighbour out of every tenant's data.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common import env
from services.common.redaction import add_secret
from services.common.secret_file import ensure_secret_file

log = logging.getLogger(__name__)

TOKEN_FILE_SETTING = env.PREFIX + "SERVICE_TOKEN_FILE"
METADATA_KEY = "x-thermocline-service-token"
MIN_TOKEN_CHARS = 32
# Open without a token: the probes' health checks and reflection (as in interceptors.py).
OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
REFUSAL_LOG_INTERVAL_S = 60.0
_MAKE_ONE = (
    "make one with `python -c 'import secrets; print(secrets.token_hex(32))' > FILE` "
    f"and set {TOKEN_FILE_SETTING}=FILE on every service"
)


class ServiceAuthError(ValueError):
    """The service token's setting or file cannot be used; the message says what to change."""


@dataclass(frozen=True)
class ServiceToken:
    """The shared secret and the file it came from; its repr shows the file, never the secret."""

    value: str = field(repr=False)
    path: Path

    def matches(self, presented: str) -> bool:
        """Whether `presented` is this token, compared in constant time."""
        return hmac.compare_digest(presented.encode(), self.value.encode())

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata entry an outgoing call carries."""
        return ((METADATA_KEY, self.value),)


def read_token(path: Path) -> ServiceToken:
    """The token in `path` (surrounding whitespace ignored): at least MIN_TOKEN_CHARS printable
    ASCII characters, none of them whitespace (it travels as a gRPC metadata value)."""
    try:
        value = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        message = f"{TOKEN_FILE_SETTING}={path}: cannot read the service token ({error})"
        raise ServiceAuthError(message) from None
    if len(value) < MIN_TOKEN_CHARS or not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise ServiceAuthError(
            f"{TOKEN_FILE_SETTING}={path}: the service token must be at least {MIN_TOKEN_CHARS} "
            f"printable ASCII characters without spaces; {_MAKE_ONE}"
        )
    add_secret(value)  # no log line of this process shows it
    return ServiceToken(value, path)


def token_from_env(environ: Mapping[str, str] | None = None) -> ServiceToken | None:
    """The token of `THERMOCLINE_SERVICE_TOKEN_FILE`, or None when it is unset."""
    path = env.get_optional_str(TOKEN_FILE_SETTING, environ)
    return None if path is None else read_token(Path(path))


def ensure_token_file(path: Path) -> Path:
    """A random token at `path` (made once, mode 0600), as `thermocline up` keeps one."""
    return ensure_secret_file(path)


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address) reaches this machine only; "0.0.0.0", "[::]" and names do not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listener(service: str, host: str, token: ServiceToken | None) -> None:
    """Refuses an internal service that would listen beyond loopback without a token."""
    if token is None and not is_loopback(host):
        raise ServiceAuthError(
            f"{service}: listening on {host} without {TOKEN_FILE_SETTING}: anyone who reaches the port "
            f"could act for any tenant. Give every service the same token file ({_MAKE_ONE}), "
            f"or listen on 127.0.0.1"
        )


def warn_if_open(service: str, token: ServiceToken | None) -> None:
    """The one warning of a loopback service that serves without a token."""
    if token is None:
        unset = TOKEN_FILE_SETTING
        log.warning("%s: %s is unset; internal calls are not authenticated (loopback only)", service, unset)


class ServiceAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection that does not carry the service token.

    A refused call still goes through the interceptors before this one (list it after the
    GuardInterceptor), so it has its span and is counted under UNAUTHENTICATED."""

    def __init__(self, token: ServiceToken) -> None:
        self._token = token
        # The caller is not trusted yet: the message names the setting, not this host's file.
        self._refusal = (
            f"this service takes calls from the mesh's services only: send the token of the file "
            f"{TOKEN_FILE_SETTING} names in the {METADATA_KEY} metadata entry; users call the gateway"
        )
        self._refusers = _refusers(self._refusal)
        self._num_refused = 0
        self._last_logged = -REFUSAL_LOG_INTERVAL_S

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES) or self._carries_token(handler_call_details):
            return handler
        self._log_refusal(method)
        return self._refusers[_kind(handler)]

    def _carries_token(self, details: grpc.HandlerCallDetails) -> bool:
        presented = [v for k, v in details.invocation_metadata or () if k == METADATA_KEY]
        return len(presented) == 1 and isinstance(presented[0], str) and self._token.matches(presented[0])

    def _log_refusal(self, method: str) -> None:
        """One WARNING a minute at most, with the count: a caller must not be able to flood the log."""
        self._num_refused += 1
        now = time.monotonic()
        if now - self._last_logged >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "refused %d call(s) without the service token (latest: %s); callers need the token "
                "this service reads from %s (%s)",
                self._num_refused,
                method,
                self._token.path,
                TOKEN_FILE_SETTING,
            )
            self._num_refused, self._last_logged = 0, now


def server_interceptors(token: ServiceToken | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors that check the token, none when there is no token to check."""
    return [] if token is None else [ServiceAuthInterceptor(token)]


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )


def _refusers(message: str) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per kind of RPC that ends the call UNAUTHENTICATED without reading a message."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler is

    return {
        "unary_unary": grpc.unary_unary_rpc_method_handler(refuse),
        "stream_unary": grpc.stream_unary_rpc_method_handler(refuse),
        "unary_stream": grpc.unary_stream_rpc_method_handler(refuse_stream),  # type: ignore[arg-type]
        "stream_stream": grpc.stream_stream_rpc_method_handler(refuse_stream),  # type: ignore[arg-type]
    }


def _with(metadata: Any, token: Sequence[tuple[str, str]]) -> tuple[tuple[str, str | bytes], ...]:
    return tuple(metadata or ()) + tuple(token)


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: ServiceToken) -> None:
        self._metadata = token.metadata

    def _add(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_SyncDetails.of(details, _with(details.metadata, self._metadata)), request)

    intercept_unary_unary = intercept_unary_stream = _add  # type: ignore[assignment]
    intercept_stream_unary = intercept_stream_stream = _add  # type: ignore[assignment]


class _SyncDetails(
    collections.namedtuple(
        "_SyncDetails", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]
    ),
    grpc.ClientCallDetails,
):
    """Call details with other metadata (grpc's own class cannot be built from outside)."""

    @classmethod
    def of(cls, details: Any, metadata: Any) -> _SyncDetails:
        """`details` with `metadata` in place of its own."""
        rest = (getattr(details, "wait_for_ready", None), getattr(details, "compression", None))
        return cls(details.method, details.timeout, metadata, details.credentials, *rest)


def authenticated(channel: grpc.Channel, token: ServiceToken | None) -> grpc.Channel:
    """A blocking channel whose calls carry `token` (the channel itself when there is none)."""
    return channel if token is None else grpc.intercept_channel(channel, _SyncTokenInterceptor(token))


class _TokenMultiCallable:
    """An aio multicallable whose calls carry the token.

    Not an aio client interceptor: grpc runs each intercepted aio call in a task of its own (about
    0.1 ms a call, telemetry.traced_stub), where this adds one tuple to the call's metadata."""

    def __init__(self, inner: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._inner = inner
        self._metadata = metadata

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(*args, metadata=_with(metadata, self._metadata), **kwargs)


class AuthenticatedChannel(grpc.aio.Channel):
    """An aio channel whose stubs' calls carry the service token; everything else is the channel's."""

    def __init__(self, channel: grpc.aio.Channel, token: ServiceToken) -> None:
        self._channel = channel
        self._metadata = token.metadata

    async def __aenter__(self) -> AuthenticatedChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._channel.__aexit__(*exc)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _TokenMultiCallable(self._channel.unary_unary(*args, **kwargs), self._metadata)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _TokenMultiCallable(self._channel.unary_stream(*args, **kwargs), self._metadata)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _TokenMultiCallable(self._channel.stream_unary(*args, **kwargs), self._metadata)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _TokenMultiCallable(self._channel.stream_stream(*args, **kwargs), self._metadata)


def authenticated_aio(channel: grpc.aio.Channel, token: ServiceToken | None) -> grpc.aio.Channel:
    """An aio channel whose calls carry `token` (the channel itself when there is none)."""
    return channel if token is None else AuthenticatedChannel(channel, token)
