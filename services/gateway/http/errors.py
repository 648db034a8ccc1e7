"""Gateway refusals as HTTP: the status OpenAI clients expect, and OpenAI's error object.

The gRPC path raises `ThermoclineError`s with actionable messages; this is the one place they
become HTTP. RESOURCE_EXHAUSTED carries its retry delay into `Retry-After` (whole seconds, rounded
up, as the header allows) and keeps the millisecond value in `retry-after-ms`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import grpc

from services.common.errors import ThermoclineError
from services.gateway.rate_limiter import RETRY_AFTER_KEY

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's `error.type` for each status (what SDKs and tooling branch on).
_ERROR_TYPE = {
    400: "invalid_request_error",
    408: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
}


class RequestTimeout(ThermoclineError):
    """The request's body did not arrive in time: HTTP 408, which has no gRPC status of its own."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 408


class HttpError(NamedTuple):
    """A status, the OpenAI error body, and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = _ERROR_TYPE.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_refusal(error: ThermoclineError) -> HttpError:
    """The HTTP form of a gateway refusal."""
    status = _status(error)
    headers = {}
    retry_ms = dict(error.trailing_metadata).get(RETRY_AFTER_KEY)
    if status == 429 and retry_ms is not None:
        headers = {"Retry-After": str(max(1, math.ceil(int(retry_ms) / 1000))), RETRY_AFTER_KEY: retry_ms}
    return HttpError(
        status, error_body(status, error.message, error.code.name.lower(), _param(error)), headers
    )


def _status(error: ThermoclineError) -> int:
    if isinstance(error, RequestTimeout):
        return RequestTimeout.http_status
    return _HTTP_STATUS.get(error.code, 500)


def _param(error: ThermoclineError) -> str | None:
    """The request field a 400 names (`field 'n': ...`), for SDKs that show `param`."""
    message = error.message
    if message.startswith("field '"):
        return message.split("'", 2)[1]
    return None


def internal(trace_id: str) -> HttpError:
    """The 500 for an unexpected failure: the trace id finds its stack trace in the gateway log."""
    message = f"internal error in the gateway; report trace id {trace_id or '(none)'} to the operator"
    return HttpError(500, error_body(500, message, "internal"), {})
