"""The gateway's settings, read from `THERMOCLINE_GATEWAY_*` variables (and `REDIS_URL`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from services.common import env
from services.common.config import ServerConfig
from services.gateway.audit import AuditConfig
from services.gateway.http.limits import HttpLimits
from services.gateway.request_bounds import RequestBounds

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8080
ALLOWED_ALGORITHMS = ("RS256", "ES256", "HS256")
MIN_TOKEN_LIFETIME_S, MAX_TOKEN_LIFETIME_S = 60.0, 366 * 24 * 3600.0
PREFIX = "THERMOCLINE_GATEWAY_"
MIB = 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class JwtConfig:
    """How bearer tokens are verified.

    `THERMOCLINE_GATEWAY_JWT_KEY_FILE`: the verification keys, either a JWKS file (each key with
    its `kid` and pinned `alg`) or one PEM public key for RS256/ES256, or a file holding a shared
    secret (at least 32 bytes) for HS256. The file is re-read when it changes (key rotation).
    `_JWT_ALGORITHM` (pinned for a PEM or secret; a JWKS pins per key), `_JWT_ISSUER`,
    `_JWT_AUDIENCE`, `_JWT_LEEWAY_S` (clock skew allowed on exp and nbf), `_JWT_TYP` (the
    required `typ` header), `_JWT_MAX_LIFETIME_S` (the longest a token may be valid: its `exp`
    at most this far from now, and from its `iat` when it has one; default 24 h, so a leaked
    token minted with a far `exp` is not a credential for good). `max_cached_tokens`: how many
    verified tokens are remembered so their repeats skip the signature check
    (verified_tokens.py); 0 verifies every call in full.
    """

    key_file: Path
    algorithm: str = "RS256"
    issuer: str = "thermocline-dev"
    audience: str = "thermocline"
    leeway_s: float = 30.0
    typ: str = "JWT"
    max_lifetime_s: float = 24 * 3600.0
    max_cached_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.algorithm not in ALLOWED_ALGORITHMS:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_JWT_ALGORITHM={self.algorithm!r}; "
                f"use one of {', '.join(ALLOWED_ALGORITHMS)}"
            )
        if not 0 <= self.leeway_s <= 300:
            raise ValueError(f"THERMOCLINE_GATEWAY_JWT_LEEWAY_S must lie in 0..300, got {self.leeway_s}")
        if not self.typ:
            raise ValueError("THERMOCLINE_GATEWAY_JWT_TYP must not be empty")
        if not MIN_TOKEN_LIFETIME_S <= self.max_lifetime_s <= MAX_TOKEN_LIFETIME_S:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_JWT_MAX_LIFETIME_S must lie in {MIN_TOKEN_LIFETIME_S:g}.."
                f"{MAX_TOKEN_LIFETIME_S:g} (one minute to 366 days), got {self.max_lifetime_s}"
            )
        if self.max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0, got {self.max_cached_tokens}")


@dataclass(frozen=True)
class PolicyFiles:
    """The operator's policy files; a missing one means the built-in development policy.

    `THERMOCLINE_GATEWAY_POLICY_FILE` (RBAC), `_INTENTS_FILE`, `_TENANTS_FILE`; formats and
    examples in deploy/gateway/.
    """

    policy_file: Path | None = None
    intents_file: Path | None = None
    tenants_file: Path | None = None


def load_policy_file(path: Path, what: str, parse: Callable[[Any], T]) -> T:
    """One JSON policy file parsed by `parse`; any problem is a ValueError naming `what` and the file."""
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{what} {path}: {error}") from None


@dataclass(frozen=True)
class LimitsConfig:
    """Load shedding and the shared rate limiter.

    `THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS`: Generate calls in flight beyond this get
    RESOURCE_EXHAUSTED with `_PUSHBACK_MS` of pushback. `REDIS_URL` holds the rate-limit buckets;
    `_REDIS_TIMEOUT_S` bounds each limiter call before the tenant's Redis-down rule applies.
    `_RATE_LEASE_HOLD_S`: how long this replica keeps a request it took from a tenant's bucket
    ahead of the tenant's next call, before giving it back (0: no leases; rate_limiter.py).
    `_MAX_STREAM_S`: the longest a Generate stream may run when its caller set no shorter deadline;
    `_WRITE_STALL_S`: the longest one message may wait for a caller that does not read. Past
    either, the stream is cancelled and its slot freed (a caller with no deadline that stops
    reading held a slot for as long as it kept its connection).
    """

    max_concurrent_streams: int = 256
    max_stream_s: float = 3600.0
    write_stall_s: float = 60.0
    pushback_ms: int = 1000
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: float = 0.25
    rate_lease_hold_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_concurrent_streams < 1:
            raise ValueError(f"{PREFIX}MAX_CONCURRENT_STREAMS must be >= 1: {self.max_concurrent_streams}")
        if self.max_stream_s <= 0 or self.write_stall_s <= 0:
            raise ValueError(
                f"{PREFIX}MAX_STREAM_S and {PREFIX}WRITE_STALL_S must be > 0, "
                f"got {self.max_stream_s} and {self.write_stall_s}"
            )
        if self.pushback_ms < 0:
            raise ValueError(f"{PREFIX}PUSHBACK_MS must be >= 0, got {self.pushback_ms}")
        if not 0 < self.redis_timeout_s <= 10:
            raise ValueError(f"{PREFIX}REDIS_TIMEOUT_S must lie in (0, 10], got {self.redis_timeout_s}")
        if not 0 <= self.rate_lease_hold_s <= 60:
            raise ValueError(f"{PREFIX}RATE_LEASE_HOLD_S must lie in [0, 60], got {self.rate_lease_hold_s}")


@dataclass(frozen=True)
class RoutingConfig:
    """How requests are spread over engine replicas.

    `THERMOCLINE_GATEWAY_ENGINE_TARGETS`: comma-separated host:port list (falls back to
    `_ENGINE_TARGET`). `_ROUTING_PREFIX_CHARS`: how much of the prompt keys prefix affinity.
    `_ROUTING_MAX_QUEUE_SKEW`: a replica whose queue is this much longer than the shortest loses
    its affinity traffic. `_ENGINE_STATS_INTERVAL_S`: how often queue depths are polled.
    """

    engine_targets: tuple[str, ...] = ("127.0.0.1:50052",)
    prefix_chars: int = 256
    max_queue_skew: int = 4
    stats_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.engine_targets or any(":" not in t for t in self.engine_targets):
            raise ValueError(f"{PREFIX}ENGINE_TARGETS must list host:port entries, got {self.engine_targets}")
        if len(set(self.engine_targets)) != len(self.engine_targets):
            raise ValueError(f"{PREFIX}ENGINE_TARGETS lists a replica twice: {self.engine_targets}")
        if self.prefix_chars < 1 or self.max_queue_skew < 0 or self.stats_interval_s <= 0:
            raise ValueError("routing: prefix chars >= 1, queue skew >= 0 and stats interval > 0 required")


class ReleasePolicy(StrEnum):
    """When generated text may reach the client, relative to the output screen; each policy's
    guarantee is in services/gateway/output_screen.py."""

    STRICT = "strict"  # held until screened, fixed windows
    GROWING = "growing"  # held until screened, windows from first_window_tokens doubling
    TRAILING = "trailing"  # released at once, at most window_tokens ahead of the screen


@dataclass(frozen=True)
class OutputScreening:
    """How output is screened and released.

    `THERMOCLINE_GATEWAY_OUTPUT_RELEASE`: `strict` (default), `growing` or `trailing`.
    `_OUTPUT_CHECK_TOKENS`: strict's window; the largest window of the others, and how far
    trailing text may run past the screened prefix. `_OUTPUT_FIRST_WINDOW_TOKENS`: the first
    window of growing and trailing.

    strict stays the default because it screens least: the safety service runs one check at a
    time, and growing windows cost about log2(window / first) more checks per stream. growing
    keeps strict's guarantee with a first token after `first_window_tokens` decode steps instead
    of `window_tokens`; it is the choice for interactive traffic when safety has headroom.
    """

    release: ReleasePolicy = ReleasePolicy.STRICT
    window_tokens: int = 16
    first_window_tokens: int = 2

    def __post_init__(self) -> None:
        if self.window_tokens < 1:
            raise ValueError(f"{PREFIX}OUTPUT_CHECK_TOKENS must be >= 1, got {self.window_tokens}")
        if not 1 <= self.first_window_tokens <= self.window_tokens:
            raise ValueError(
                f"{PREFIX}OUTPUT_FIRST_WINDOW_TOKENS must lie in 1..{self.window_tokens} "
                f"(OUTPUT_CHECK_TOKENS), got {self.first_window_tokens}"
            )

    def window_after(self, num_screened: int) -> int:
        """Tokens in the next window once `num_screened` tokens passed: fixed for strict; for the
        others the screened prefix doubles from `first_window_tokens` until windows reach
        `window_tokens`."""
        if self.release is ReleasePolicy.STRICT:
            return self.window_tokens
        return min(self.window_tokens, max(self.first_window_tokens, num_screened))


def _release_policy(value: str) -> ReleasePolicy:
    try:
        return ReleasePolicy(value)
    except ValueError:
        known = ", ".join(p.value for p in ReleasePolicy)
        raise ValueError(f"{PREFIX}OUTPUT_RELEASE={value!r}; use one of {known}") from None


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway forwards requests and how it screens them.

    `THERMOCLINE_GATEWAY_SAFETY_TARGET` (host:port, or several addresses in gRPC's target syntax,
    taken in turn: upstream.py);
    `output`: how output is screened and released (OutputScreening: `_OUTPUT_RELEASE`, ...);
    `_SAFETY_TIMEOUT_S`: the longest a safety check may take before the request fails UNAVAILABLE;
    `_HTTP_PORT`: the OpenAI-compatible HTTP front's port, on the gRPC server's host; 0 turns it off;
    `http_limits`: its connection and request limits (`_HTTP_*`, http/limits.py).
    The gRPC server's message limit is the smaller of `_MAX_MESSAGE_MB` and what `bounds` needs.
    """

    server: ServerConfig
    jwt: JwtConfig
    audit: AuditConfig
    policies: PolicyFiles = field(default_factory=PolicyFiles)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    bounds: RequestBounds = field(default_factory=RequestBounds)
    safety_target: str = "127.0.0.1:50053"
    output: OutputScreening = field(default_factory=OutputScreening)
    safety_timeout_s: float = 5.0
    http_port: int = DEFAULT_HTTP_PORT
    http_limits: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        if self.safety_timeout_s <= 0:
            raise ValueError(f"THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S must be > 0, got {self.safety_timeout_s}")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_HTTP_PORT must be 0 (off) or a TCP port, got {self.http_port}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """Reads the gateway's settings; the JWT key file is required."""
        bounds = RequestBounds(
            max_prompt_bytes=env.get_int(
                PREFIX + "MAX_PROMPT_BYTES", RequestBounds.max_prompt_bytes, environ
            ),
            default_max_tokens=env.get_int(
                PREFIX + "DEFAULT_MAX_TOKENS", RequestBounds.default_max_tokens, environ
            ),
        )
        server = ServerConfig.from_env("gateway", DEFAULT_PORT, environ, is_public=True)
        return cls(
            server=replace(server, max_message_bytes=min(server.max_message_bytes, bounds.max_message_bytes)),
            bounds=bounds,
            jwt=_jwt_from_env(environ),
            audit=_audit_from_env(environ),
            policies=PolicyFiles(
                policy_file=_optional_path(PREFIX + "POLICY_FILE", environ),
                intents_file=_optional_path(PREFIX + "INTENTS_FILE", environ),
                tenants_file=_optional_path(PREFIX + "TENANTS_FILE", environ),
            ),
            limits=_limits_from_env(environ),
            routing=_routing_from_env(environ),
            safety_target=env.get_str(PREFIX + "SAFETY_TARGET", "127.0.0.1:50053", environ),
            output=_output_from_env(environ),
            safety_timeout_s=env.get_float(PREFIX + "SAFETY_TIMEOUT_S", 5.0, environ),
            http_port=env.get_int(PREFIX + "HTTP_PORT", DEFAULT_HTTP_PORT, environ),
            http_limits=HttpLimits.from_env(environ),
        )


def _output_from_env(environ: Mapping[str, str] | None) -> OutputScreening:
    window_tokens = env.get_int(PREFIX + "OUTPUT_CHECK_TOKENS", 16, environ)
    first_window_tokens = min(2, window_tokens)
    return OutputScreening(
        release=_release_policy(env.get_str(PREFIX + "OUTPUT_RELEASE", "strict", environ)),
        window_tokens=window_tokens,
        first_window_tokens=env.get_int(PREFIX + "OUTPUT_FIRST_WINDOW_TOKENS", first_window_tokens, environ),
    )


def _optional_path(name: str, environ: Mapping[str, str] | None) -> Path | None:
    value = env.get_optional_str(name, environ)
    return None if value is None else Path(value)


def _jwt_from_env(environ: Mapping[str, str] | None) -> JwtConfig:
    key_file = env.get_optional_str(PREFIX + "JWT_KEY_FILE", environ)
    if key_file is None:
        raise ValueError(
            f"{PREFIX}JWT_KEY_FILE is not set; point it at the token verification key or JWKS "
            "(`thermocline up` makes a development key pair for you)"
        )
    return JwtConfig(
        key_file=Path(key_file),
        algorithm=env.get_str(PREFIX + "JWT_ALGORITHM", "RS256", environ),
        issuer=env.get_str(PREFIX + "JWT_ISSUER", "thermocline-dev", environ),
        audience=env.get_str(PREFIX + "JWT_AUDIENCE", "thermocline", environ),
        leeway_s=env.get_float(PREFIX + "JWT_LEEWAY_S", 30.0, environ),
        typ=env.get_str(PREFIX + "JWT_TYP", "JWT", environ),
        max_lifetime_s=env.get_float(PREFIX + "JWT_MAX_LIFETIME_S", JwtConfig.max_lifetime_s, environ),
    )


def _audit_from_env(environ: Mapping[str, str] | None) -> AuditConfig:
    state_dir = env.get_str("THERMOCLINE_STATE_DIR", "var", environ)
    return AuditConfig(
        directory=Path(env.get_str(PREFIX + "AUDIT_DIR", str(Path(state_dir) / "audit"), environ)),
        retention_days=env.get_float(PREFIX + "AUDIT_RETENTION_DAYS", 90.0, environ),
        admin_retention_days=env.get_float(PREFIX + "AUDIT_ADMIN_RETENTION_DAYS", 365.0, environ),
        rotate_bytes=int(env.get_float(PREFIX + "AUDIT_ROTATE_MB", 64.0, environ) * MIB),
        key_file=_optional_path(PREFIX + "AUDIT_KEY_FILE", environ),
        checkpoint_interval_s=env.get_float(PREFIX + "AUDIT_CHECKPOINT_S", 60.0, environ),
        unauthenticated_per_s=env.get_float(PREFIX + "AUDIT_UNAUTHENTICATED_PER_S", 10.0, environ),
        free_refusals_per_s=env.get_float(PREFIX + "AUDIT_FREE_REFUSALS_PER_S", 10.0, environ),
    )


def _limits_from_env(environ: Mapping[str, str] | None) -> LimitsConfig:
    return LimitsConfig(
        max_concurrent_streams=env.get_int(PREFIX + "MAX_CONCURRENT_STREAMS", 256, environ),
        max_stream_s=env.get_float(PREFIX + "MAX_STREAM_S", 3600.0, environ),
        write_stall_s=env.get_float(PREFIX + "WRITE_STALL_S", 60.0, environ),
        pushback_ms=env.get_int(PREFIX + "PUSHBACK_MS", 1000, environ),
        redis_url=env.redis_url(environ),
        redis_timeout_s=env.get_float(PREFIX + "REDIS_TIMEOUT_S", 0.25, environ),
        rate_lease_hold_s=env.get_float(PREFIX + "RATE_LEASE_HOLD_S", 5.0, environ),
    )


def _routing_from_env(environ: Mapping[str, str] | None) -> RoutingConfig:
    single = env.get_str(PREFIX + "ENGINE_TARGET", "127.0.0.1:50052", environ)
    targets = env.get_str(PREFIX + "ENGINE_TARGETS", single, environ)
    return RoutingConfig(
        engine_targets=tuple(t.strip() for t in targets.split(",") if t.strip()),
        prefix_chars=env.get_int(PREFIX + "ROUTING_PREFIX_CHARS", 256, environ),
        max_queue_skew=env.get_int(PREFIX + "ROUTING_MAX_QUEUE_SKEW", 4, environ),
        stats_interval_s=env.get_float(PREFIX + "ENGINE_STATS_INTERVAL_S", 0.5, environ),
    )
