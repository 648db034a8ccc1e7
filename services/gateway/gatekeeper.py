"""The ordered checks a call passes before it reaches the engine, each decision audited.

Order: the JWT, then RBAC (role → model → operation), then the intent, then the token budget,
then the tenant's rate limit. The first refusal ends the call with its status; allow or deny,
the decision is in the audit log (fsynced) before the caller hears of it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from services.common import telemetry
from services.common.errors import ThermoclineError, Unauthenticated
from services.gateway.audit import ALLOW, DENY, AuditEvent, AuditLog, prompt_sha256
from services.gateway.auth import JwtVerifier, Principal
from services.gateway.budget import PromptCounter, check_request_budget
from services.gateway.intents import IntentPolicy
from services.gateway.rate_limiter import RateLimiter, refuse
from services.gateway.rbac import Policy
from services.gateway.tenants import TenantLimits, TenantTable, is_valid_tenant
from thermocline.gateway.v1 import gateway_pb2 as pb

ModelResolver = Callable[[str], Awaitable[str]]
DEFAULT_MAX_TOKENS = 256  # what the engine uses for max_tokens 0; the gateway sends it explicitly
_MAX_REQUEST_ID_CHARS = 128


class Policies(NamedTuple):
    """The operator's three policy documents."""

    rbac: Policy
    intents: IntentPolicy
    tenants: TenantTable


@dataclass(frozen=True)
class Admission:
    """A call that passed every check, with what the rest of the path needs."""

    principal: Principal
    model: str
    intent: str
    priority_class: str
    prompt_tokens: int
    max_tokens: int
    limits: TenantLimits
    request_id: str


@dataclass
class _Facts:
    """What is known about a call so far, for its audit event."""

    action: str
    resource: str
    request_id: str
    prompt_sha256: str = ""
    actor_principal: str = "unauthenticated"
    tenant: str = ""
    details: dict[str, Any] = field(default_factory=dict)

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


def request_id_of(metadata: Mapping[str, str]) -> str:
    """The caller's `x-request-id` (bounded), or a fresh one."""
    given = metadata.get("x-request-id", "")
    return given[:_MAX_REQUEST_ID_CHARS] if given.isprintable() and given else uuid.uuid4().hex


class Gatekeeper:
    """Runs the checks and writes the audit trail."""

    def __init__(
        self,
        verifier: JwtVerifier,
        policies: Policies,
        counter: PromptCounter,
        limiter: RateLimiter,
        audit: AuditLog,
    ) -> None:
        self.verifier = verifier
        self.policy, self.intents, self.tenants = policies
        self.counter = counter
        self.limiter = limiter
        self.audit = audit

    def authenticate(self, metadata: Mapping[str, str]) -> Principal:
        """The verified caller with its roles."""
        principal = self.verifier.verify(metadata.get("authorization"))
        if not is_valid_tenant(principal.tenant):
            raise Unauthenticated("token's tenant claim must be 1-128 characters of [A-Za-z0-9._@-]")
        return replace(principal, roles=self.policy.roles_of(principal.claims))

    async def admit_generate(
        self, request: pb.GenerateRequest, text: str, metadata: Mapping[str, str], resolve: ModelResolver
    ) -> Admission:
        """Every check for one Generate call; the decision is durable when this returns or raises."""
        facts = _Facts("invoke", "model:?", request_id_of(metadata), prompt_sha256(text))
        try:
            admission = await self._check_generate(request, metadata, resolve, facts)
        except ThermoclineError as error:
            await self.audit.record(facts.event(DENY, error.message))
            raise
        await self.audit.record(facts.event(ALLOW, "all checks passed"))
        return admission

    async def _check_generate(
        self, request: pb.GenerateRequest, metadata: Mapping[str, str], resolve: ModelResolver, facts: _Facts
    ) -> Admission:
        principal = self.authenticate(metadata)
        facts.actor_principal, facts.tenant = principal.subject, principal.tenant
        model = await resolve(request.model)
        facts.resource = f"model:{model}"
        self.policy.authorize(principal.subject, principal.roles, "invoke", model)
        limits = self.tenants.limits(principal.tenant)
        intent = self.intents.resolve(metadata.get("x-intent"))
        priority_class = self.intents.priority_class(intent, limits.intent_classes)
        facts.details |= {"intent": intent, "priority_class": priority_class}
        max_tokens = request.sampling.max_tokens or DEFAULT_MAX_TOKENS
        prompt_tokens = self.counter.count(request)
        facts.details |= {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
        check_request_budget(principal.tenant, limits, prompt_tokens, max_tokens, self.counter.name)
        await self._take_rate(principal.tenant, limits, prompt_tokens, facts)
        return Admission(
            principal, model, intent, priority_class, prompt_tokens, max_tokens, limits, facts.request_id
        )

    async def _take_rate(self, tenant: str, limits: TenantLimits, prompt_tokens: int, facts: _Facts) -> None:
        decision = await self.limiter.take(tenant, limits, prompt_tokens)
        if decision.is_degraded:
            facts.details["rate_limit"] = "redis unreachable; tenant fails open"
        if not decision.is_admitted:
            raise refuse(tenant, limits, decision)

    async def admit_list_models(self, metadata: Mapping[str, str], models: list[str]) -> list[str]:
        """The models the caller may list; PERMISSION_DENIED when it may list none."""
        facts = _Facts("list_models", "model:*", request_id_of(metadata))
        try:
            principal = self.authenticate(metadata)
            facts.actor_principal, facts.tenant = principal.subject, principal.tenant
            allowed = [m for m in models if self.policy.is_allowed(principal.roles, "list_models", m)]
            if not allowed:
                self.policy.authorize(principal.subject, principal.roles, "list_models", models[0])
        except ThermoclineError as error:
            await self.audit.record(facts.event(DENY, error.message))
            raise
        await self.audit.record(facts.event(ALLOW, f"{len(allowed)} model(s) listed"))
        return allowed

    async def record(self, event: AuditEvent) -> None:
        """Writes an event that is not an admission decision (e.g. a safety block)."""
        await self.audit.record(event)
