"""Domain errors and the one place they become gRPC status codes.

Domain code raises a subclass of `ThermoclineError` with a message a user can act on; the
server interceptor turns it into the matching status. Anything else becomes INTERNAL with
the request's trace id, so the operator can find the stack trace in the log.
"""

from __future__ import annotations

import grpc


class ThermoclineError(Exception):
    """An error with a gRPC status code and a message for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.trailing_metadata = trailing_metadata


class InvalidArgument(ThermoclineError):
    """The request itself is malformed or out of range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(ThermoclineError):
    """No credentials, or credentials that do not verify."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ThermoclineError):
    """Authenticated, but not allowed to do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ThermoclineError):
    """The named thing (model, block) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ThermoclineError):
    """A limit is reached: rate, memory, queue or concurrency."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ThermoclineError):
    """The system is not in a state to serve this request."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ThermoclineError):
    """A dependency is down or the server is draining; retrying elsewhere may work."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ThermoclineError):
    """The request ran out of time."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(ThermoclineError):
    """The server failed while serving the request (a fault or a bug); the message says what failed."""

    code = grpc.StatusCode.INTERNAL


class Unimplemented(ThermoclineError):
    """The RPC exists in the contract but this version does not serve it."""

    code = grpc.StatusCode.UNIMPLEMENTED
