"""The OpenAI-compatible HTTP routes, served by uvicorn inside the gateway's own event loop.

Starlette routes each call to the same `GatewayServicer` the gRPC server uses: the headers
become call metadata (Authorization, X-Intent, X-Request-Id, X-Retrieval-Mode), the body
becomes a GenerateRequest, and the stream comes back as JSON or SSE. The checks only HTTP has
(the body, its JSON, the headers) come first, in intake.py, and are audited there. W3C
`traceparent` starts the HTTP server span, which the gRPC path's spans then join.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.common import telemetry
from services.common.errors import ThermoclineError, Unavailable
from services.common.interceptors import CallTracker
from services.gateway.call_metadata import new_request_id
from services.gateway.http.call import Generation
from services.gateway.http.errors import HttpError, error_body, from_refusal, internal
from services.gateway.http.framing import CloseAfterUnreadBody, RefuseAmbiguousFraming
from services.gateway.http.in_flight import CountInFlight
from services.gateway.http.intake import GenerateCall, Intake, draining, is_draining
from services.gateway.http.limits import HttpLimits
from services.gateway.http.metrics import CountRequests
from services.gateway.http.openai_request import Endpoint, OpenAIRequest
from services.gateway.http.openai_response import Rendering, completed, sse
from services.gateway.http.server import WRITE_STALL_STATE
from services.gateway.servicer import GatewayServicer
from services.gateway.upstream import Upstreams
from thermocline.gateway.v1 import gateway_pb2 as pb

CLIENT_CLOSED_REQUEST = 499
_tracer = telemetry.tracer(__name__)
log = logging.getLogger(__name__)


class OpenAIRoutes:
    """The handlers; each one a thin shell around the servicer."""

    def __init__(
        self,
        servicer: GatewayServicer,
        upstreams: Upstreams,
        max_body_bytes: int,
        limits: HttpLimits,
        calls: CallTracker,
    ) -> None:
        self.servicer = servicer
        self.upstreams = upstreams  # whose readiness /ready answers
        self.intake = Intake(servicer.gatekeeper, servicer.slots, max_body_bytes, limits)
        self.calls = calls  # in flight, for the drain
        self._serving: list[str] | None = None  # the replicas /ready saw serving last

    def app(self) -> Starlette:
        """The ASGI application: each request counted in flight (for the drain) and, once finished,
        by route and status code, ambiguously framed requests refused before routing, and a
        connection closed after an answer sent before its request's body was read; its state
        carries the write-stall limit for the server."""
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
        ]
        app = Starlette(
            routes=routes,
            middleware=[
                Middleware(CountInFlight, calls=self.calls),
                Middleware(CountRequests, routes=[route.path for route in routes]),
                Middleware(RefuseAmbiguousFraming),
                Middleware(CloseAfterUnreadBody),
            ],
            exception_handlers={HTTPException: _http_exception},
        )
        # "/v1/models/" is a 404, not a redirect to a Location built from the caller's Host header
        app.router.redirect_slashes = False
        # the server cuts a client that reads nothing for as long as the gRPC front allows
        setattr(app.state, WRITE_STALL_STATE, self.servicer.config.limits.write_stall_s)
        return app

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def health(self, request: Request) -> Response:
        """Liveness: the process answers."""
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness: not draining, at least one engine replica serves (SERVING, and takes the
        gateway's service token), and the safety service does not refuse that token."""
        if is_draining():
            return _error_response(from_refusal(draining()))
        serving = [r.target for r in self.upstreams.router.replicas if r.is_serving]
        self._log_serving(serving)
        problem = self.upstreams.readiness_problem()
        if problem is not None:
            return _error_response(from_refusal(Unavailable(problem)))
        return JSONResponse({"status": "ready", "engines_serving": len(serving)})

    def _log_serving(self, serving: list[str]) -> None:
        """Logs the serving replicas' addresses when they change: /ready answers anyone, so it
        tells only their number, and the mesh's addresses stay in the operator's log."""
        if serving != self._serving:
            self._serving = serving
            log.info("engine replicas serving: %s", ", ".join(serving) or "none")

    async def models(self, request: Request) -> Response:
        """GET /v1/models: what the caller's roles may list."""
        span = _server_span(request, "GET /v1/models")
        with trace.use_span(span, end_on_exit=True):
            try:
                context = await self.intake.list_models(request, new_request_id())
                reply = await self.servicer.ListModels(pb.ListModelsRequest(), context)
            except ThermoclineError as error:
                return _refused(span, from_refusal(error))
            data = [
                {"id": m.name, "object": "model", "created": 0, "owned_by": "thermocline"}
                for m in reply.models
            ]
            return JSONResponse({"object": "list", "data": data})

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        span = _server_span(request, f"POST {request.url.path}")
        request_id = new_request_id()  # the caller's X-Request-Id is recorded beside it, never as it
        try:
            with trace.use_span(span):
                call = await self.intake.generate(request, endpoint, request_id)
                _annotate(span, call.parsed)
                generation = Generation(
                    self.servicer.Generate(call.parsed.request, call.context), span, call.timeout_s
                )
        except ClientDisconnect:
            return _ended(span, _hung_up(span))
        except ThermoclineError as error:
            return _ended(span, _refused(span, from_refusal(error)))
        except Exception:
            return _ended(span, _unexpected(span))
        try:
            return await self._answer(request, call, generation, request_id, span)
        except ClientDisconnect:  # the engine request ends with the generation's task
            generation.cancel()
            return _ended(span, _hung_up(span))
        except Exception:
            generation.cancel()
            return _ended(span, _unexpected(span))
        except asyncio.CancelledError:  # the server's own shutdown
            generation.cancel()
            span.end()
            raise

    async def _answer(
        self, request: Request, call: GenerateCall, generation: Generation, request_id: str, span: trace.Span
    ) -> Response:
        """The answer once the call is running: an error, one JSON body, or an SSE stream."""
        headers, parsed = {"x-request-id": request_id}, call.parsed
        async with _cancelled_on_disconnect(request):
            with trace.use_span(span):
                try:
                    first = await _first(generation)
                    model = await self._answering_model(parsed.request.model, call.context.time_remaining())
                except ThermoclineError as error:
                    return _ended(span, _refused(span, from_refusal(error)))
                rendering = Rendering(parsed, request_id, model)
                if not parsed.is_stream:
                    return _ended(span, await _whole_answer(generation, first, rendering, headers, span))
        # From here Starlette's StreamingResponse notices a disconnect and cancels the stream.
        stream = _sse_events(generation, first, rendering, span)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def _answering_model(self, requested: str, timeout_s: float | None) -> str:
        """The model an answer names, as its final message will: the one the request named, else
        the default the gateway routed it to. The stream's first message comes after admission,
        which resolved the default, so the engine's model description is then already fetched."""
        return requested or (await self.servicer.upstreams.model_info(timeout_s)).model


@contextlib.asynccontextmanager
async def _cancelled_on_disconnect(request: Request) -> AsyncIterator[None]:
    """Cancels the handler when the client hangs up, so its engine request is cancelled too; the
    cancellation comes out as ClientDisconnect, which the handler answers as a quiet 499.

    The body has been read, so the next ASGI receive returns only `http.disconnect`; this is how
    Starlette's StreamingResponse watches a stream, applied here to the wait before the answer.
    """
    handler = asyncio.current_task()
    assert handler is not None
    has_hung_up = False

    async def watch() -> None:
        nonlocal has_hung_up
        while (await request.receive())["type"] != "http.disconnect":
            pass
        has_hung_up = True
        handler.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if has_hung_up and handler.uncancel() == 0:  # only this watcher's cancellation
            raise ClientDisconnect() from None
        raise
    finally:
        watcher.cancel()


def _server_span(request: Request, name: str) -> trace.Span:
    """The HTTP server span, a child of the caller's `traceparent` when it sent one."""
    parent = propagate.extract(dict(request.headers))
    span = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
    span.set_attribute("http.request.method", request.method)
    span.set_attribute("http.route", request.url.path)
    span.set_attribute("url.scheme", request.url.scheme)
    span.set_attribute("user_agent.original", request.headers.get("user-agent", "")[:256])
    return span


def _annotate(span: trace.Span, parsed: OpenAIRequest) -> None:
    if parsed.user:
        span.set_attribute("thermocline.openai.user", parsed.user)
    span.set_attribute("thermocline.openai.stream", parsed.is_stream)


async def _first(generation: Generation) -> pb.GenerateResponse:
    """The stream's first message: every check has passed once it arrives."""
    first = await generation.next()
    if first is None:
        raise Unavailable("the gateway ended the stream before any answer; retry the request")
    return first


async def _whole_answer(
    generation: Generation,
    first: pb.GenerateResponse,
    rendering: Rendering,
    headers: dict[str, str],
    span: trace.Span,
) -> Response:
    """Reads the stream to its end and answers once."""
    deltas, message = [], first
    try:
        while not message.HasField("done"):
            deltas.append(message.delta)
            if (message := await generation.next()) is None:  # type: ignore[assignment]
                raise Unavailable("the engine ended the stream without a final message; retry the request")
        done = completed(message)
    except ThermoclineError as error:
        return _refused(span, from_refusal(error))
    except Exception:
        return _refused(span, internal(telemetry.current_trace_id()))
    span.set_attribute("http.response.status_code", 200)
    return JSONResponse(rendering.body(_whole_text(deltas, done), done), headers=headers)


def _whole_text(deltas: list[pb.TextDelta], done: pb.Completion) -> str:
    """The text of a whole answer. A blocked prompt or output gives the safe message alone, which
    comes as a delta of its own with no token ids (it is no model output; output_screen.py):
    under trailing release the text sent before it ran up to a window past what the screen had
    passed, the blocked text among it, and a caller that waits for the whole answer gains nothing
    from text released early. (The engine's own gate ends a text the screen passed whole with its
    safe message; that text stays.)"""
    if done.finish_reason == pb.FINISH_REASON_SAFETY and deltas and not deltas[-1].token_ids:
        return deltas[-1].text
    return "".join(delta.text for delta in deltas)


async def _sse_events(
    generation: Generation, first: pb.GenerateResponse, rendering: Rendering, span: trace.Span
) -> AsyncIterator[bytes]:
    """SSE chunks until [DONE]; a failure mid-stream becomes an `error` event (status is sent)."""
    span.set_attribute("http.response.status_code", 200)
    message: pb.GenerateResponse | None = first
    is_first = True
    try:
        while message is not None and not message.HasField("done"):
            yield rendering.chunk(message.delta.text, is_first=is_first)
            is_first = False
            message = await generation.next()
        if message is None:
            raise Unavailable("the engine ended the stream without a final message; retry the request")
        for event in rendering.closing(completed(message)):
            yield event
    except ThermoclineError as error:
        yield sse(from_refusal(error).body)
    except Exception:
        with trace.use_span(span):
            yield sse(internal(telemetry.current_trace_id()).body)
    finally:
        generation.cancel()
        span.end()


def _refused(span: trace.Span, refusal: HttpError) -> Response:
    span.set_attribute("http.response.status_code", refusal.status)
    if refusal.status >= 500:
        span.set_status(StatusCode.ERROR, refusal.body["error"]["message"])
    return _error_response(refusal)


async def _http_exception(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) as OpenAI error objects, with the
    headers they carry (a 405's Allow)."""
    status = error.status_code if isinstance(error, HTTPException) else 500
    headers = error.headers if isinstance(error, HTTPException) else None
    message = (
        f"{request.method} {request.url.path}: {error.detail if isinstance(error, HTTPException) else error}"
    )
    if status == 404:
        message += "; this server serves /v1/chat/completions, /v1/completions, /v1/models, /health, /ready"
    elif status == 405 and headers and "Allow" in headers:
        message += f"; this path takes {headers['Allow']}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "bad_request")
    return JSONResponse(error_body(status, message, code), status, headers=headers)


def _hung_up(span: trace.Span) -> Response:
    """The client went away before its answer: 499 (nginx's code) in the span and the request
    counter, and nothing in the log; the answer itself goes nowhere."""
    span.set_attribute("http.response.status_code", CLIENT_CLOSED_REQUEST)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def _unexpected(span: trace.Span) -> Response:
    """A 500 that names the trace id; the stack trace goes to the gateway's log."""
    with trace.use_span(span):
        log.exception("HTTP call failed unexpectedly")
        return _refused(span, internal(telemetry.current_trace_id()))


def _ended(span: trace.Span, response: Response) -> Response:
    span.end()
    return response


def _error_response(refusal: HttpError) -> Response:
    return JSONResponse(refusal.body, status_code=refusal.status, headers=refusal.headers)
