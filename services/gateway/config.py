"""The gateway's settings, read from `THERMOCLINE_GATEWAY_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.config import ServerConfig

DEFAULT_PORT = 50051
ALLOWED_ALGORITHMS = ("RS256", "ES256", "HS256")


@dataclass(frozen=True)
class JwtConfig:
    """How bearer tokens are verified.

    `THERMOCLINE_GATEWAY_JWT_KEY_FILE`: the verification key, a PEM public key for RS256/ES256
    or a file holding the shared secret (at least 32 bytes) for HS256.
    `_JWT_ALGORITHM` (pinned: a token claiming any other algorithm is refused), `_JWT_ISSUER`,
    `_JWT_AUDIENCE`, `_JWT_LEEWAY_S` (clock skew allowed on exp and nbf).
    """

    key_file: Path
    algorithm: str = "RS256"
    issuer: str = "thermocline-dev"
    audience: str = "thermocline"
    leeway_s: float = 30.0

    def __post_init__(self) -> None:
        if self.algorithm not in ALLOWED_ALGORITHMS:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_JWT_ALGORITHM={self.algorithm!r}; "
                f"use one of {', '.join(ALLOWED_ALGORITHMS)}"
            )
        if not 0 <= self.leeway_s <= 300:
            raise ValueError(f"THERMOCLINE_GATEWAY_JWT_LEEWAY_S must lie in 0..300, got {self.leeway_s}")


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway forwards requests and how it screens them.

    `THERMOCLINE_GATEWAY_ENGINE_TARGET` and `_SAFETY_TARGET` (host:port);
    `_OUTPUT_CHECK_TOKENS`: output is held back and screened every this many tokens (and at the end);
    `_SAFETY_TIMEOUT_S`: the longest a safety check may take before the request fails UNAVAILABLE.
    """

    server: ServerConfig
    jwt: JwtConfig
    engine_target: str = "127.0.0.1:50052"
    safety_target: str = "127.0.0.1:50053"
    output_check_tokens: int = 16
    safety_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.output_check_tokens < 1:
            raise ValueError(
                f"THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS must be >= 1, got {self.output_check_tokens}"
            )
        if self.safety_timeout_s <= 0:
            raise ValueError(f"THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S must be > 0, got {self.safety_timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """Reads the gateway's settings; the JWT key file is required."""
        prefix = "THERMOCLINE_GATEWAY_"
        key_file = env.get_optional_str(prefix + "JWT_KEY_FILE", environ)
        if key_file is None:
            raise ValueError(
                f"{prefix}JWT_KEY_FILE is not set; point it at the token verification key "
                "(`thermocline up` makes a development key pair for you)"
            )
        jwt = JwtConfig(
            key_file=Path(key_file),
            algorithm=env.get_str(prefix + "JWT_ALGORITHM", "RS256", environ),
            issuer=env.get_str(prefix + "JWT_ISSUER", "thermocline-dev", environ),
            audience=env.get_str(prefix + "JWT_AUDIENCE", "thermocline", environ),
            leeway_s=env.get_float(prefix + "JWT_LEEWAY_S", 30.0, environ),
        )
        return cls(
            server=ServerConfig.from_env("gateway", DEFAULT_PORT, environ),
            jwt=jwt,
            engine_target=env.get_str(prefix + "ENGINE_TARGET", "127.0.0.1:50052", environ),
            safety_target=env.get_str(prefix + "SAFETY_TARGET", "127.0.0.1:50053", environ),
            output_check_tokens=env.get_int(prefix + "OUTPUT_CHECK_TOKENS", 16, environ),
            safety_timeout_s=env.get_float(prefix + "SAFETY_TIMEOUT_S", 5.0, environ),
        )
