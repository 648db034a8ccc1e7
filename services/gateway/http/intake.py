"""The checks only the HTTP front makes, before a call reaches the servicer, each refusal audited
(but the gateway's stream cap's).

Order for a generation call: the drain, the gateway's cap on concurrent streams, the body's
declared size, the token, one request from the tenant's rate limit, the headers (`X-Timeout-S`,
`X-Retrieval-Mode`), then the body, read within its deadline and up to the size limit, as JSON
and as a request this API serves. A gateway at its stream cap refuses a call from its head, as it
refuses a gRPC call before any other work, with the same refusal and unaudited, as that one is:
a flood of large bodies to a full gateway costs it no body read, no token check and no Redis
call. The servicer checks the cap again once the body is in, which a call that came with room
may find full. The token comes before the body so that a client without one cannot make the
gateway hold a body it sends slowly or never finishes: it is answered 401 and its connection
closed (framing.py) with the body unread. The servicer verifies the token again (the
gatekeeper's verified-token cache makes that a lookup).

The request is taken as the gatekeeper takes it on gRPC, right after the token, so that every
later refusal (a late, oversized or malformed body) costs the caller its rate, and a caller over
its rate gets 429 before its body is read. It is the call's request: a call whose body passes
carries the front's take to the servicer in its `HttpCallContext.request_taken`, and the
gatekeeper takes none of its own, so the caller pays one request per call and the call costs one
Redis round trip for it. (The context is the front's object: no header or metadata entry sets it.)

The servicer's gatekeeper audits every decision it makes; the refusals made here go to the same
audit log, in its form (action `invoke` on `model:?`, or `list_models` on `model:*`), before
the caller hears of them. Those made before the token has verified pass through the
gatekeeper's rate of unauthenticated events, as on gRPC; after it they name the caller, and
those that cost the caller a request are always written (the rate limit itself, reached, costs
nothing and is sampled per tenant, as on gRPC). A client that goes away before its body is in is
no decision: it is not audited.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from opentelemetry import trace
from starlette.requests import ClientDisconnect, Request

from services.common import telemetry
from services.common.errors import InvalidArgument, ResourceExhausted, ThermoclineError, Unavailable
from services.common.metrics import DRAINING
from services.gateway.admission import StreamSlots
from services.gateway.audit import DENY, UNAUTHENTICATED, AuditEvent
from services.gateway.auth import Principal
from services.gateway.call_metadata import CLIENT_REQUEST_ID_KEY, CallMetadata, client_request_id_of
from services.gateway.gatekeeper import Gatekeeper
from services.gateway.http.call import HttpCallContext
from services.gateway.http.errors import RequestTimeout
from services.gateway.http.limits import HttpLimits
from services.gateway.http.openai_request import Endpoint, OpenAIRequest, parse
from services.gateway.rate_limiter import RateDecision, refuse
from services.gateway.request_bounds import MAX_METADATA_VALUE_CHARS

# Headers passed on as call metadata, as a gRPC client would send them (every copy: the
# gatekeeper refuses a repeated one).
FORWARDED_HEADERS = ("authorization", "x-intent", CLIENT_REQUEST_ID_KEY, "x-retrieval-mode")
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 3600.0


class GenerateCall(NamedTuple):
    """A generation call that passed the front's checks: the request, its context, its deadline."""

    parsed: OpenAIRequest
    context: HttpCallContext
    timeout_s: float


@dataclass
class _Facts:
    """What the front knows of a call it refuses, for the audit event."""

    action: str
    resource: str
    request_id: str  # the front's own
    client_request_id: str  # the caller's X-Request-Id ("" when it sent none)
    principal: Principal | None = None  # once the token has verified
    has_paid: bool = False  # once a request was taken from the tenant's bucket

    @classmethod
    def of(cls, action: str, resource: str, request: Request, request_id: str) -> _Facts:
        """What the front knows of a call as it arrives."""
        client_request_id = client_request_id_of(request.headers.get(CLIENT_REQUEST_ID_KEY, ""))
        return cls(action, resource, request_id, client_request_id)

    def denied(self, reason: str) -> AuditEvent:
        details = {"client_request_id": self.client_request_id} if self.client_request_id else {}
        return AuditEvent(
            actor_principal=self.principal.subject if self.principal else UNAUTHENTICATED,
            tenant=self.principal.tenant if self.principal else "",
            action=self.action,
            resource=self.resource,
            decision=DENY,
            reason=reason,
            request_id=self.request_id,
            trace_id=telemetry.current_trace_id(),
            details=details | {"front": "http"},
        )


class Intake:
    """Runs the front's own checks; the refusals they make are in the audit log when they raise."""

    def __init__(
        self, gatekeeper: Gatekeeper, slots: StreamSlots, max_body_bytes: int, limits: HttpLimits
    ) -> None:
        self.gatekeeper = gatekeeper
        self.slots = slots  # the servicer's, shared with the gRPC front
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = limits.body_timeout_s

    async def generate(self, request: Request, endpoint: Endpoint, request_id: str) -> GenerateCall:
        """The call a POST to a generation endpoint asks for; ClientDisconnect if the client goes
        away before its body is in."""
        facts = _Facts.of("invoke", "model:?", request, request_id)
        if not is_draining():  # the drain's own refusal, audited, comes below
            self._check_room()
        async with self._audited(facts):
            if is_draining():
                raise draining()
            self._check_declared_size(request)
            facts.principal = self._authenticate(request)
            taken = await self._take_request(facts.principal.tenant)
            facts.has_paid = True
            timeout_s = timeout_s_of(request)  # the headers are checked before the body is read
            metadata = metadata_of(request)
            parsed = parse(endpoint, _json(await self._body(request)))
        # X-Timeout-S counts from here, where the Generation's own timeout starts: the body's
        # reading has a deadline of its own, and the engine and safety get the whole budget.
        context = HttpCallContext(metadata, time.monotonic() + timeout_s, request_id, taken)
        return GenerateCall(parsed, context, timeout_s)

    async def list_models(self, request: Request, request_id: str) -> HttpCallContext:
        """The context of a GET /v1/models call."""
        async with self._audited(_Facts.of("list_models", "model:*", request, request_id)):
            deadline_at = time.monotonic() + timeout_s_of(request)
            return HttpCallContext(metadata_of(request), deadline_at, request_id)

    @contextlib.asynccontextmanager
    async def _audited(self, facts: _Facts) -> AsyncIterator[None]:
        """Any refusal inside, expected or not, is in the audit log before it propagates."""
        try:
            yield
        except ThermoclineError as error:
            await self._record(
                facts, facts.denied(error.message), is_free=isinstance(error, ResourceExhausted)
            )
            raise
        except ClientDisconnect:
            raise
        except Exception:
            await self._record(facts, facts.denied("internal error in the gateway's HTTP front"))
            raise

    async def _record(self, facts: _Facts, event: AuditEvent, is_free: bool = False) -> None:
        """Writes a refusal as the gatekeeper writes its own: one that cost the caller nothing (no
        verified token, no request taken yet, or the rate limit itself) one by one up to the
        audit rate and counted beyond it; one that cost it a request always."""
        if facts.principal is None:
            sampled_as: str | None = UNAUTHENTICATED
        else:
            sampled_as = facts.principal.tenant if is_free or not facts.has_paid else None
        await self.gatekeeper.record_denial(event, sampled_as)

    async def _take_request(self, tenant: str) -> RateDecision:
        """The call's one request from the tenant's bucket, as the gatekeeper takes it on gRPC; 429
        with Retry-After when the tenant is over its rate."""
        limits = self.gatekeeper.tenants.limits(tenant)
        decision = await self.gatekeeper.limiter.take_request(tenant, limits)
        if not decision.is_admitted:
            raise refuse(tenant, limits, decision)
        return decision

    def _authenticate(self, request: Request) -> Principal:
        """The caller, as the gatekeeper verifies it (every Authorization header, so two are refused)."""
        credentials = [("authorization", value) for value in request.headers.getlist("authorization")]
        return self.gatekeeper.authenticate(CallMetadata(credentials))

    def _check_room(self) -> None:
        """RESOURCE_EXHAUSTED with pushback, the servicer's own refusal, when the gateway's streams
        are at their cap."""
        if not self.slots.can_admit():
            with self.slots.hold():  # raises, full: the refusal is the cap's own, and nothing is held
                pass

    def _check_declared_size(self, request: Request) -> None:
        """Refuses a Content-Length over the limit before the token or any of the body is read."""
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > self.max_body_bytes:
            raise self._too_large()

    async def _body(self, request: Request) -> bytes:
        """The body, read within its deadline and no further than the size limit."""
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > self.max_body_bytes:
                        raise self._too_large()
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.body_timeout_s:g} s of its headers "
                f"({len(body)} bytes came); send it at once"
            ) from None
        return bytes(body)

    def _too_large(self) -> InvalidArgument:
        return InvalidArgument(
            f"request body exceeds {self.max_body_bytes} bytes (the prompt limit plus its envelope); "
            "shorten the prompt"
        )


def _json(body: bytes) -> Any:
    """The body parsed as JSON, every object's keys unique."""
    try:
        return json.loads(_utf8(body), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise InvalidArgument(
            "request body nests too deeply to parse; an OpenAI request nests a few levels at most"
        ) from None
    except ValueError as error:  # bad JSON or UTF-8, or an integer of over 4300 digits
        reason = str(error).partition(";")[0]  # not Python's advice to raise its digit limit
        raise InvalidArgument(f"request body is not valid JSON: {reason}") from None


def _utf8(body: bytes) -> str:
    """The body as UTF-8 text, strictly: json.loads of bytes also reads UTF-16 and UTF-32 and
    skips a byte order mark, which a proxy or WAF reading UTF-8 (RFC 8259 §8.1) does not, so it
    would screen other text than this server serves."""
    if body.startswith(codecs.BOM_UTF8):
        raise InvalidArgument(
            "request body starts with a UTF-8 byte order mark; send JSON in UTF-8 without one"
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(
            f"request body is not UTF-8 (byte {error.start}); send JSON encoded as UTF-8"
        ) from None
    if "\x00" in text:  # never in JSON text; ASCII in UTF-16 or UTF-32 is valid UTF-8 with NULs
        raise InvalidArgument("request body holds a NUL byte (UTF-16 or UTF-32?); send JSON encoded as UTF-8")
    return text


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object, refused when it repeats a key: JSON readers differ on which copy wins
    (Python's the last, many proxies and WAFs the first), so one body would be two requests."""
    fields = dict(pairs)
    if len(fields) < len(pairs):
        raise InvalidArgument(
            f"request body repeats the key {_first_repeated(pairs)!r} in one object; readers disagree "
            "on which copy counts (a proxy may read the first, this server the last): send each key once"
        )
    return fields


def _first_repeated(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no key repeats")


def is_draining() -> bool:
    """Whether the process's server runner has begun its drain (after SIGTERM); it says so in a gauge."""
    return any(sample.value for metric in DRAINING.collect() for sample in metric.samples)


def draining() -> Unavailable:
    """What a call gets once the drain has begun, as gRPC callers get UNAVAILABLE."""
    return Unavailable("the gateway is shutting down; retry on another replica")


def metadata_of(request: Request) -> list[tuple[str, str]]:
    """Headers as call metadata; every copy of each, so two are refused as on gRPC."""
    pairs: list[tuple[str, str]] = []
    for name in FORWARDED_HEADERS:
        pairs.extend((name, value) for value in request.headers.getlist(name))
    mode = request.headers.get("x-retrieval-mode", "")
    if len(mode) > MAX_METADATA_VALUE_CHARS:
        raise InvalidArgument(f"header 'X-Retrieval-Mode' is over {MAX_METADATA_VALUE_CHARS} characters")
    if mode:
        trace.get_current_span().set_attribute("thermocline.retrieval_mode", mode)
    return pairs


def timeout_s_of(request: Request) -> float:
    """`X-Timeout-S` (the HTTP stand-in for a gRPC deadline), else the default."""
    raw = request.headers.get("x-timeout-s")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        timeout_s = float(raw)
    except ValueError:
        timeout_s = -1.0
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"header 'X-Timeout-S' must be seconds in (0, {MAX_TIMEOUT_S:g}], got {raw!r}")
    return timeout_s
