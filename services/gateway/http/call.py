"""One HTTP call run through the gRPC path's servicer.

`HttpCallContext` gives the servicer what it reads from a gRPC context (metadata, the time left),
so the HTTP front reuses every check, the relay and the audit trail as they are. `Generation`
runs the servicer's stream in a task of its own: the HTTP span is current in that task from
the first check to the last token, so every client span below it (Redis, safety, engine) joins
the caller's trace, and cancelling the task is how a disconnected client cancels the engine. The
drain's cut cancels it too, wherever it waits; the servicer's stream then ends with the cut's error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common.errors import DeadlineExceeded, ThermoclineError
from services.gateway.rate_limiter import RateDecision
from thermocline.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger(__name__)

QUEUE_MESSAGES = 64  # a slow reader holds the relay back after this many messages, not the memory
_END: Any = object()


class HttpCallContext:
    """The parts of a grpc.aio.ServicerContext that the gateway servicer reads."""

    def __init__(
        self,
        metadata: list[tuple[str, str]],
        deadline_at: float | None,
        request_id: str,
        request_taken: RateDecision | None = None,
    ) -> None:
        self._metadata = tuple(metadata)
        self.deadline_at = deadline_at
        # The front's id of the call, which its answer names (`x-request-id`, the completion's
        # id), so the gatekeeper's events carry it too. The front's take of this call's request
        # from the tenant's bucket (intake.py), which the gatekeeper then does not repeat. A gRPC
        # context has neither attribute, and no metadata entry sets them.
        self.request_id = request_id
        self.request_taken = request_taken

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The request headers the gatekeeper reads, as gRPC metadata pairs."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the call's deadline; None without one."""
        return None if self.deadline_at is None else max(0.0, self.deadline_at - time.monotonic())


class Generation:
    """A servicer stream consumed in its own task, with the HTTP span current; read with `next`."""

    def __init__(
        self, messages: AsyncGenerator[pb.GenerateResponse, None], span: trace.Span, timeout_s: float
    ) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=QUEUE_MESSAGES)
        self._timeout_s = timeout_s
        self._task = asyncio.create_task(self._produce(messages, span))

    async def _produce(self, messages: AsyncGenerator[pb.GenerateResponse, None], span: trace.Span) -> None:
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            async with asyncio.timeout(self._timeout_s):
                async for message in messages:
                    await self._queue_message(message, messages)
            await self._queue.put(_END)
        except TimeoutError:
            await self._queue.put(
                DeadlineExceeded(f"the request's deadline of {self._timeout_s:g} s passed; raise X-Timeout-S")
            )
        except ThermoclineError as error:
            await self._queue.put(error)
        except Exception as error:  # reported as a 500 with the trace id
            log.exception("HTTP generation failed unexpectedly")
            span.record_exception(error)
            await self._queue.put(error)
        finally:
            await messages.aclose()  # closes the relay: the engine call ends
            otel_context.detach(token)

    async def _queue_message(
        self, message: pb.GenerateResponse, messages: AsyncGenerator[pb.GenerateResponse, None]
    ) -> None:
        """Queues `message`. A cancellation that comes while the queue is full (a client reading
        slowly) is thrown into `messages` at its `yield`, where the servicer's stream stands, as the
        gRPC server's write loop does (services/common/interceptors.py): a stream the drain cut
        ends there, audited as stream.cut, with the error that says so, which is queued. Left to
        `_produce`, the cancellation would only close the stream (GeneratorExit), unaudited. The
        interrupted message is queued ahead of whatever follows: the stream counted it as sent."""
        while True:
            try:
                await self._queue.put(message)
                return
            except asyncio.CancelledError as cancelled:
                try:
                    following = await messages.athrow(cancelled)
                except StopAsyncIteration:
                    await self._queue.put(message)
                    return
                except ThermoclineError:
                    await self._queue.put(message)
                    raise
                await self._queue.put(message)
                message = following

    async def next(self) -> pb.GenerateResponse | None:
        """The next message; None at the end; raises the refusal or failure that ended the stream."""
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Ends the call (a client that went away): the relay cancels the engine request."""
        self._task.cancel()
