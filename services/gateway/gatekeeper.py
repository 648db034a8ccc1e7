"""The ordered checks a call passes before it reaches the engine, each decision audited.

Order: the prompt's size in bytes, then the JWT, then one request from the tenant's rate limit,
then the size of every other caller-supplied field, then RBAC (role → model → operation), then
the request's content (the model exists, the intent, sampling ranges, what the model's engine
would refuse: its max_tokens limit, its chat template and roles, the token budget), then
the prompt's tokens plus max_tokens from the rate limit: a reservation of the most the call can
spend, which the stream's end settles with what it used (`Admission.charge`). The byte limit
comes first because it is the cheapest check and the one a flood of oversized prompts hits: such
a call costs neither a signature check nor a Redis round trip (and costs the caller no budget; a
bad token costs none either).
Authentication and the rate limit come before any other work, so every later refusal has cost
the caller budget; sizes are checked before any field reaches a message or the tokenizer; RBAC
comes before NOT_FOUND, so a caller without a role learns nothing about which models are served.
A call from the HTTP front arrives with its request already taken (the front takes it once the
token verifies, before it reads the body: `request_taken`), so the gatekeeper takes none, and
checks the prompt's size after the (cached) token: the caller has paid by then.
The first refusal ends the call with its status; allow or deny, the decision is in the audit log
(fsynced) before the caller hears of it. Once a Generate call is authorized and valid, the
servicer's `on_prompt_ready` starts the prompt's safety screen, which then runs beside the token
count, the token budget and the audit write instead of after them. A refusal is on disk when
`admit_generate` raises; an allowed call's event is still being written when it returns
(`Admitted.recorded`), so the engine starts beside the fsync, and the servicer tells the caller
nothing, neither a message nor an error, before that write is done.
A call's events carry the gateway's own request id (call_metadata.new_request_id); the caller's
`x-request-id` goes in their details as `client_request_id`, so no caller can stamp its events
with another call's id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from services.common import telemetry
from services.common.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ThermoclineError,
    Unauthenticated,
)
from services.common.tenancy import RESERVED_TENANTS
from services.gateway.admission import TenantStreams
from services.gateway.audit import ALLOW, DENY, UNAUTHENTICATED, AuditEvent, AuditLog, prompt_sha256
from services.gateway.audit_sampling import DenialSampler
from services.gateway.auth import JwtVerifier, Principal
from services.gateway.budget import PromptCounter, check_request_budget, refuse_reservation
from services.gateway.call_metadata import CallMetadata, new_request_id
from services.gateway.completion_charge import CompletionCharge
from services.gateway.intents import IntentPolicy
from services.gateway.off_loop import off_loop_when_long
from services.gateway.rate_limiter import RateDecision, RateLimiter, refuse
from services.gateway.rbac import Policy
from services.gateway.request_bounds import (
    EngineLimits,
    RequestBounds,
    check_engine_limits,
    check_metadata,
    check_prompt_size,
    check_sampling,
    check_sizes,
)
from services.gateway.tenants import TenantLimits, TenantTable, is_valid_tenant
from thermocline.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger(__name__)


class ServedModel(NamedTuple):
    """A model an engine serves, and what that engine refuses."""

    name: str
    limits: EngineLimits


# The model a call asks for ("": the default); NOT_FOUND when it is not served.
ModelResolver = Callable[[str], Awaitable[ServedModel]]
# Awaited once a Generate call is authenticated, authorized and validated, with the prompt text:
# the servicer starts the prompt's safety screen there and returns once its request is sent, so
# that it runs beside the remaining checks (the engine's token count, the token budget and
# bucket, the audit write) instead of waiting behind their CPU work.
PromptReady = Callable[[str, "Principal", "TenantLimits"], Awaitable[None]]
ModelLister = Callable[[], Awaitable[list[str]]]
# The seconds a call has left before its deadline (None: no deadline), as a context's time_remaining.
TimeLeft = Callable[[], float | None]
# Prompts up to this length are screened beside the token count (a few ms of screening, hidden
# behind it); longer ones after the count, budget and token rate passed. A long prompt's screen
# costs safety hundreds of ms of CPU, which a caller over its budget must not be able to spend.
SCREEN_BEFORE_COUNT_MAX_CHARS = 4096
MAX_SAMPLED_TENANTS = 10_000  # tenants whose free refusals are sampled; a token names its tenant


class Policies(NamedTuple):
    """The operator's three policy documents."""

    rbac: Policy
    intents: IntentPolicy
    tenants: TenantTable


@dataclass(frozen=True)
class Admission:
    """A call that passed every check, with what the rest of the path needs. `charge` settles the
    call's token reservation; whoever ends the call must end it (`stream_ended`) on every path."""

    principal: Principal
    model: str
    prompt_text: str
    intent: str
    priority_class: str
    prompt_tokens: int
    max_tokens: int
    limits: TenantLimits
    request_id: str  # the gateway's own id of the call
    charge: CompletionCharge
    client_request_id: str = ""  # the caller's `x-request-id`, recorded beside it

    def event_details(self, details: dict[str, Any]) -> dict[str, Any]:
        """An audit event's details about this call, the caller's own request id first."""
        if not self.client_request_id:
            return details
        return {"client_request_id": self.client_request_id} | details


class Admitted(NamedTuple):
    """An allowed Generate call, and the write of its allow event: a future that is done once the
    event is on disk, or fails (UNAVAILABLE) when it could not be written."""

    admission: Admission
    recorded: asyncio.Future[None]


@dataclass
class _Facts:
    """What is known about a call so far, for its audit event."""

    action: str
    resource: str
    request_id: str
    prompt_sha256: str = ""
    num_prompt_chars: int = 0  # not audited: how long the text to hash is
    actor_principal: str = UNAUTHENTICATED
    tenant: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    # The HTTP front's take of the call's request from the tenant's bucket; None: not taken yet.
    # Never from metadata, which the caller writes: only the HTTP front's call context carries it.
    request_taken: RateDecision | None = None
    time_left: TimeLeft = field(default=lambda: None)  # the call's seconds left (None: no deadline)

    def event(self, decision: str, reason: str) -> AuditEvent:
        return AuditEvent(
            actor_principal=self.actor_principal,
            tenant=self.tenant,
            action=self.action,
            resource=self.resource,
            decision=decision,
            reason=reason,
            request_id=self.request_id,
            trace_id=telemetry.current_trace_id(),
            prompt_sha256=self.prompt_sha256,
            details=dict(self.details),
        )


def _mark_retrieved(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # awaiting the task still raises it


def _facts_of(action: str, resource: str, metadata: CallMetadata, request_id: str | None) -> _Facts:
    """What is known of a call as it arrives: the gateway's id for it (the HTTP front's, which its
    answer carries, or a fresh one) and, first in its details, the id the caller sent, if any."""
    facts = _Facts(action, resource, request_id or new_request_id())
    if client_request_id := metadata.client_request_id:
        facts.details["client_request_id"] = client_request_id
    return facts


def prompt_text(request: pb.GenerateRequest) -> str:
    """The text the safety service screens: the prompt, or every turn of the chat."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:  # the engine refuses it too, after admission and the screen
            raise InvalidArgument("prompt is empty; send some text")
        return request.prompt
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidArgument("chat has no messages; send at least one turn")
        return "\n".join(f"{m.role}: {m.content}" for m in request.chat.messages)
    raise InvalidArgument("request has no input: set either prompt or chat")


def prompt_turns(request: pb.GenerateRequest) -> tuple[str, ...]:
    """A chat's turns as the safety service screens them, each message's content alone; none for
    a raw prompt. Role labels and a system prompt beside a question move its harm scores away from
    where the gate was calibrated on plain prompts, so each turn is screened on its own too."""
    if request.WhichOneof("input") != "chat":
        return ()
    return tuple(m.content for m in request.chat.messages)


def prompt_roles(request: pb.GenerateRequest) -> tuple[str, ...]:
    """A chat's roles, one per turn of prompt_turns, which the safety service joins turns by; none
    for a raw prompt."""
    if request.WhichOneof("input") != "chat":
        return ()
    return tuple(m.role for m in request.chat.messages)


def _note_degraded(decision: RateDecision, facts: _Facts) -> None:
    """Notes a fail-open limiter in the audit details."""
    if decision.is_degraded:
        facts.details["rate_limit"] = "redis unreachable; tenant fails open"


def _check_rate(tenant: str, limits: TenantLimits, decision: RateDecision, facts: _Facts) -> None:
    """Notes a fail-open limiter in the audit details; raises the refusal of a refused call."""
    _note_degraded(decision, facts)
    if not decision.is_admitted:
        raise refuse(tenant, limits, decision)


class Gatekeeper:
    """Runs the checks and writes the audit trail."""

    def __init__(
        self,
        verifier: JwtVerifier,
        policies: Policies,
        counter: PromptCounter,
        limiter: RateLimiter,
        audit: AuditLog,
        bounds: RequestBounds,
        tenant_streams: TenantStreams,
    ) -> None:
        self.verifier = verifier
        self.policy, self.intents, self.tenants = policies
        self.counter = counter
        self.limiter = limiter
        self.audit = audit
        self.bounds = bounds
        # Taken for an admitted Generate call; the servicer gives it back when the stream ends.
        self.tenant_streams = tenant_streams
        # Refusals that cost the caller nothing, sampled (audit_sampling.py): the unauthenticated
        # together, a verified caller's per tenant.
        self.unauthenticated = DenialSampler("", audit.config.unauthenticated_per_s)
        self._free_refusals: dict[str, DenialSampler] = {}

    def authenticate(self, metadata: CallMetadata) -> Principal:
        """The verified caller with its roles."""
        credentials = metadata.get_all("authorization")
        if len(credentials) > 1:
            raise Unauthenticated(
                f"{len(credentials)} 'authorization' metadata entries sent; send exactly one bearer token"
            )
        principal = self.verifier.verify(credentials[0] if credentials else None)
        if not is_valid_tenant(principal.tenant):
            raise Unauthenticated("token's 'tenant' claim must be 1-128 characters of [A-Za-z0-9._@-]")
        if principal.tenant in RESERVED_TENANTS:
            raise Unauthenticated(
                f"token's 'tenant' claim {principal.tenant!r} is a name the services keep for their own "
                "requests (their cache would be shared); ask the issuer for a token with another tenant"
            )
        return replace(principal, roles=self.policy.roles_of(principal.claims))

    async def admit_generate(
        self,
        request: pb.GenerateRequest,
        metadata: CallMetadata,
        resolve: ModelResolver,
        on_prompt_ready: PromptReady | None = None,
        request_taken: RateDecision | None = None,
        time_left: TimeLeft | None = None,
        request_id: str | None = None,
    ) -> Admitted:
        """Every check for one Generate call. A refusal is durable when this raises; an allow is
        durable once `recorded` is done, which the caller awaits before it answers. An admitted
        call holds one of its tenant's stream slots: the caller gives it back
        (`tenant_streams.release`) when the stream ends.
        `on_prompt_ready` is awaited once the call is authorized and its fields valid: before the
        token count for a prompt of at most SCREEN_BEFORE_COUNT_MAX_CHARS, where a refusal after it
        (budget, token rate) may follow a screen already started; after it for a longer prompt.
        `request_taken`: the HTTP front's take of this call's request, so none is taken here.
        `time_left`: the call's seconds left (the context's `time_remaining`), which bound the count.
        `request_id`: the HTTP front's id of the call; a gRPC call gets a fresh one."""
        facts = _facts_of("invoke", "model:?", metadata, request_id)
        facts.request_taken = request_taken
        if time_left is not None:
            facts.time_left = time_left
        checks = self._check_generate(request, metadata, resolve, facts, on_prompt_ready)
        admission = await self._audited(facts, checks)
        # Queued now, so that it comes before any event of the answer (a safety block) in the log.
        try:
            recorded = self.audit.submit(facts.event(ALLOW, "all checks passed"))
        except BaseException:
            self.tenant_streams.release(admission.principal.tenant)
            admission.charge.refused()
            raise
        recorded.add_done_callback(_mark_retrieved)  # a failure no caller reads is not logged as lost
        return Admitted(admission, recorded)

    async def _audited(self, facts: _Facts, checks: Awaitable[Any]) -> Any:
        """Runs `checks`; any refusal, expected or not, is in the audit log before it propagates."""
        try:
            return await checks
        except ThermoclineError as error:
            if facts.actor_principal == UNAUTHENTICATED:
                sampled_as: str | None = UNAUTHENTICATED
            else:  # a rate limit or stream cap reached takes nothing from the bucket
                sampled_as = facts.tenant if isinstance(error, ResourceExhausted) else None
            await self.record_denial(facts.event(DENY, error.message), sampled_as)
            raise
        except Exception:
            log.exception("admission check failed unexpectedly")
            await self.audit.record(facts.event(DENY, "internal error in the gateway's checks"))
            raise

    async def record_denial(self, event: AuditEvent, sampled_as: str | None) -> None:
        """Writes a refusal; one that cost the caller nothing is sampled (`sampled_as`:
        UNAUTHENTICATED, or the verified caller's tenant): written one by one up to the audit rate,
        counted beyond it. The HTTP front's own refusals come here too."""
        sampler = self._sampler(sampled_as)
        if sampler is not None and not sampler.admit():
            sampler.count(event.reason, event.timestamp_utc)  # in the next summary (every minute)
            return
        await self.audit.record(event)

    def _sampler(self, sampled_as: str | None) -> DenialSampler | None:
        if sampled_as is None:
            return None
        if sampled_as == UNAUTHENTICATED:
            return self.unauthenticated
        sampler = self._free_refusals.get(sampled_as)
        if sampler is None:
            if len(self._free_refusals) >= MAX_SAMPLED_TENANTS:
                return None  # past the bound, written one by one
            sampler = DenialSampler(sampled_as, self.audit.config.free_refusals_per_s)
            self._free_refusals[sampled_as] = sampler
        return sampler

    async def record_summaries(self) -> None:
        """Writes the counts of every sampler's refusals left out since its last summary."""
        for sampler in [self.unauthenticated, *self._free_refusals.values()]:
            await self._record_summary(sampler)

    async def _record_summary(self, sampler: DenialSampler) -> None:
        if (summary := sampler.summary()) is not None:
            await self.audit.record(summary)  # a failure leaves the counts for the next summary
            sampler.written()

    async def _check_generate(
        self,
        request: pb.GenerateRequest,
        metadata: CallMetadata,
        resolve: ModelResolver,
        facts: _Facts,
        on_prompt_ready: PromptReady | None,
    ) -> Admission:
        if facts.request_taken is None:  # before any signature check or Redis call
            check_prompt_size(request, self.bounds)
        principal, limits = await self._identify(metadata, facts)
        if facts.request_taken is not None:  # paid for: its refusal names the caller, always audited
            check_prompt_size(request, self.bounds)
        self.tenant_streams.take(principal.tenant, limits.max_streams)
        charge: CompletionCharge | None = None  # once the call's tokens are reserved
        try:
            if not limits.safety.is_empty:  # categories the safety service will not apply as is
                facts.details["tenant_safety_policy"] = limits.safety.describe()
            check_metadata(metadata)
            check_sizes(request)
            text = prompt_text(request)
            facts.prompt_sha256 = await off_loop_when_long(prompt_sha256, text, len(text))
            facts.num_prompt_chars = len(text)
            served = await self._authorize_model(principal, request.model, resolve, facts)
            model = served.name
            intent = self.intents.resolve(metadata.get("x-intent"), principal.roles)
            priority_class = self.intents.priority_class(intent, limits.intent_classes)
            facts.details |= {"intent": intent, "priority_class": priority_class}
            check_sampling(request.sampling)
            max_tokens = request.sampling.max_tokens or self.bounds.default_max_tokens
            check_engine_limits(request, max_tokens, model, served.limits)
            # A short prompt's screen starts here, beside the token count and budget; a long one's
            # only once they passed, so a call refused for its budget or rate costs no long screen.
            screens_early = len(text) <= SCREEN_BEFORE_COUNT_MAX_CHARS
            if on_prompt_ready is not None and screens_early:
                await on_prompt_ready(text, principal, limits)
            prompt_tokens, charge = await self._reserve_tokens(
                request, model, principal.tenant, limits, max_tokens, facts
            )
            if on_prompt_ready is not None and not screens_early:
                await on_prompt_ready(text, principal, limits)
            return Admission(
                principal,
                model,
                text,
                intent,
                priority_class,
                prompt_tokens,
                max_tokens,
                limits,
                facts.request_id,
                charge,
                metadata.client_request_id,
            )
        except BaseException:
            self.tenant_streams.release(principal.tenant)  # refused: the slot was never used
            if charge is not None:
                charge.refused()  # the prompt stays spent; the max_tokens go back
            raise

    async def _authorize_model(
        self, principal: Principal, requested: str, resolve: ModelResolver, facts: _Facts
    ) -> ServedModel:
        """RBAC on the model asked for (the default when none), then whether it is served."""
        model = requested or (await resolve("")).name
        facts.resource = f"model:{model}"
        try:
            self.policy.authorize(principal.subject, principal.roles, "invoke", model)
        except PermissionDenied as denied:
            if requested:
                raise
            # The default model's name is not the caller's to learn before it may invoke it.
            held = ", ".join(principal.roles) if principal.roles else "none"
            raise PermissionDenied(
                f"permission 'invoke' on the default model is missing: caller {principal.subject!r} "
                f"holds roles [{held}]; ask an administrator for a role that grants it"
            ) from denied
        return await resolve(requested)

    async def _reserve_tokens(
        self,
        request: pb.GenerateRequest,
        model: str,
        tenant: str,
        limits: TenantLimits,
        max_tokens: int,
        facts: _Facts,
    ) -> tuple[int, CompletionCharge]:
        """Counts the prompt (the engine tokenizes; this loop only awaits), checks it, and takes the
        prompt plus `max_tokens` from the tenant's bucket at once: the most the call can spend, so
        concurrent calls never spend more than the bucket holds. Returns the prompt's count and the
        charge that settles the max_tokens part with the completion's actual tokens."""
        prompt_tokens = await self.counter.count(request, model, facts.num_prompt_chars, facts.time_left())
        facts.details |= {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
        check_request_budget(tenant, limits, prompt_tokens, max_tokens, self.counter.name)
        decision = await self.limiter.take_tokens(tenant, limits, prompt_tokens + max_tokens)
        _note_degraded(decision, facts)
        if not decision.is_admitted:
            raise refuse_reservation(tenant, limits, decision, prompt_tokens, max_tokens)
        num_reserved = 0 if decision.is_degraded else max_tokens  # fails open: nothing was taken
        return prompt_tokens, CompletionCharge(self.limiter, tenant, limits, num_reserved)

    async def _identify(self, metadata: CallMetadata, facts: _Facts) -> tuple[Principal, TenantLimits]:
        """Authenticates the caller and takes one request from its tenant's bucket, unless the HTTP
        front took it already (`facts.request_taken`)."""
        principal = self.authenticate(metadata)
        facts.actor_principal, facts.tenant = principal.subject, principal.tenant
        limits = self.tenants.limits(principal.tenant)
        decision = facts.request_taken
        if decision is None:
            decision = await self.limiter.take_request(principal.tenant, limits)
        _check_rate(principal.tenant, limits, decision, facts)
        return principal, limits

    async def admit_list_models(
        self, metadata: CallMetadata, list_models: ModelLister, request_id: str | None = None
    ) -> list[str]:
        """The models the caller may list; PERMISSION_DENIED when it may list none. `request_id`:
        the HTTP front's id of the call; a gRPC call gets a fresh one."""
        facts = _facts_of("list_models", "model:*", metadata, request_id)
        allowed = await self._audited(facts, self._check_list_models(metadata, list_models, facts))
        await self.audit.record(facts.event(ALLOW, f"{len(allowed)} model(s) listed"))
        return allowed

    async def _check_list_models(
        self, metadata: CallMetadata, list_models: ModelLister, facts: _Facts
    ) -> list[str]:
        principal, _ = await self._identify(metadata, facts)
        models = await list_models()
        allowed = [m for m in models if self.policy.is_allowed(principal.roles, "list_models", m)]
        if not allowed:
            self.policy.authorize(principal.subject, principal.roles, "list_models", "*")
        return allowed

    async def record(self, event: AuditEvent) -> None:
        """Writes an event that is not an admission decision (e.g. a safety block)."""
        await self.audit.record(event)
