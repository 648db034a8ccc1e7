"""The gateway process's parts, built from its config: policies, audit log, limiter, router, servicer."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path

import grpc

from services.common.errors import ThermoclineError
from services.common.interceptors import CallTracker
from services.gateway import grpc_edge
from services.gateway.admission import StreamSlots, TenantStreams
from services.gateway.audit import ALLOW, AuditEvent, AuditLog
from services.gateway.auth import JwtVerifier
from services.gateway.budget import PromptCounter
from services.gateway.config import GatewayConfig
from services.gateway.gatekeeper import Gatekeeper, Policies
from services.gateway.http.app import OpenAIRoutes
from services.gateway.http.server import HttpServer
from services.gateway.intents import DEVELOPMENT_INTENTS, IntentPolicy
from services.gateway.rate_limiter import RateLimiter
from services.gateway.rbac import DEVELOPMENT_POLICY, Policy
from services.gateway.router import Router
from services.gateway.servicer import GatewayServicer
from services.gateway.tenants import TenantTable
from services.gateway.upstream import Upstreams

log = logging.getLogger(__name__)


def load_policies(config: GatewayConfig) -> Policies:
    """The operator's policy files, or the development defaults for those not configured."""
    files = config.policies
    if files.policy_file is None:
        log.warning("THERMOCLINE_GATEWAY_POLICY_FILE is unset; using the development RBAC policy")
    policy = Policy.load(files.policy_file) if files.policy_file else Policy.from_dict(DEVELOPMENT_POLICY)
    intents = IntentPolicy.from_dict(DEVELOPMENT_INTENTS)
    if files.intents_file:
        intents = IntentPolicy.load(files.intents_file)
    tenants = TenantTable.load(files.tenants_file) if files.tenants_file else TenantTable()
    return Policies(policy, intents, tenants)


_PRUNE_INTERVAL_S = 3600.0
_UNAUTHENTICATED_SUMMARY_S = 60.0  # how often the counts of sampled refusals are written
# How long a gateway whose tenants loosen safety categories waits for the safety service at start.
SAFETY_START_WAIT_S = 60.0


def _file_digest(path: Path | None) -> str:
    return "built-in development default" if path is None else hashlib.sha256(path.read_bytes()).hexdigest()


def policy_event(config: GatewayConfig) -> AuditEvent:
    """The admin-stream record of which policy files (by sha256) this gateway process enforces."""
    files = {
        "jwt_key_file": config.jwt.key_file,
        "policy_file": config.policies.policy_file,
        "intents_file": config.policies.intents_file,
        "tenants_file": config.policies.tenants_file,
    }
    return AuditEvent(
        actor_principal="thermocline-gateway",
        tenant="",
        action="policy.load",
        resource="gateway:policies",
        decision=ALLOW,
        reason="gateway started",
        details={name: {"path": str(path), "sha256": _file_digest(path)} for name, path in files.items()},
    )


class Gateway:
    """Everything the gateway process owns, built from its config, started and closed as one."""

    def __init__(self, config: GatewayConfig, http_calls: CallTracker) -> None:
        policies = load_policies(config)
        self.http_calls = http_calls  # the HTTP front's in flight, which the drain waits on too
        self.audit = AuditLog(config.audit)
        limits = config.limits
        self.limiter = RateLimiter(limits.redis_url, limits.redis_timeout_s, limits.rate_lease_hold_s)
        self.upstreams = Upstreams(Router(config.routing), config.safety_target, config.safety_timeout_s)
        gatekeeper = Gatekeeper(
            JwtVerifier(config.jwt),
            policies,
            PromptCounter(self.upstreams),
            self.limiter,
            self.audit,
            config.bounds,
            TenantStreams(config.limits.pushback_ms),
        )
        slots = StreamSlots(config.limits.max_concurrent_streams, config.limits.pushback_ms)
        self.servicer = GatewayServicer(config, gatekeeper, self.upstreams, slots)
        self.config = config
        self.tenants = policies.tenants
        self.http = self._http_server(config)
        self._pruner: asyncio.Task[None] | None = None
        self._summarizer: asyncio.Task[None] | None = None

    def _http_server(self, config: GatewayConfig) -> HttpServer | None:
        """The OpenAI-compatible front on the same servicer; None when its port is 0."""
        if config.http_port == 0:
            return None
        limits = config.http_limits
        routes = OpenAIRoutes(
            self.servicer, self.upstreams, config.bounds.max_message_bytes, limits, self.http_calls
        )
        return HttpServer(routes.app(), config.server.host, config.http_port, limits)

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Adds the servicer; returns its full service name."""
        return [grpc_edge.add_to_server(self.servicer, server)]

    async def start(self) -> None:
        """Checks the tenants' safety overrides against the gate, starts following the engine
        replicas and polling the safety service, records the policies in force, starts pruning."""
        await self._check_safety_overrides()
        await self.upstreams.start()
        await self.audit.record(policy_event(self.config))
        self._pruner = asyncio.create_task(self._prune_forever())
        self._summarizer = asyncio.create_task(self._summarize_forever())
        if self.http is not None:
            await self.http.start()

    async def _check_safety_overrides(self) -> None:
        """A tenants file that turns off or loosens a category the gate lacks, or sets a threshold
        below the gate's own, stops the gateway here rather than failing that tenant's calls."""
        if not self.tenants.has_safety_overrides:
            return
        path = self.config.policies.tenants_file
        try:
            gate = await self.upstreams.gate_info(SAFETY_START_WAIT_S)
        except ThermoclineError as error:
            raise ValueError(
                f"tenants file {path}: its safety overrides are checked against the safety "
                f"service's gate at start, and the check failed: {error.message}"
            ) from None
        try:
            warnings = self.tenants.check_against_gate(gate.categories, gate.version)
        except ValueError as error:
            raise ValueError(f"tenants file {path}: {error}") from None
        for warning in warnings:
            log.warning("tenants file %s: %s", path, warning)
        log.info("tenant safety overrides checked against gate %s", gate.version)

    async def _summarize_forever(self) -> None:
        """Writes the counts of sampled refusals left out of the audit log, every interval."""
        while True:
            await asyncio.sleep(_UNAUTHENTICATED_SUMMARY_S)
            try:
                await self.servicer.gatekeeper.record_summaries()
            except ThermoclineError:  # e.g. a full disk: the counts are in the next summary
                log.exception("a summary of sampled refusals could not be written")

    async def _prune_forever(self) -> None:
        """Applies audit retention now and then every hour."""
        while True:
            try:
                await asyncio.to_thread(self.audit.prune)
            except OSError:  # e.g. a full disk: the next round tries again; calls are refused meanwhile
                log.exception("audit retention could not run")
            await asyncio.sleep(_PRUNE_INTERVAL_S)

    async def close(self) -> None:
        """Stops the HTTP front (the drain has waited for its calls, or cut them), then closes
        channels, limiter, audit."""
        if self.http is not None:
            await self.http.stop()
        if self._pruner is not None:
            self._pruner.cancel()
        if self._summarizer is not None:
            self._summarizer.cancel()
        with contextlib.suppress(ThermoclineError):  # a full disk: logged by the audit log
            await self.servicer.gatekeeper.record_summaries()
        await self.upstreams.close()
        await self.limiter.close()
        self.audit.close()
