"""The server settings every service shares, read from `THERMOCLINE_<SERVICE>_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common import env
from services.common.service_auth import ServiceToken, check_listener, token_from_env

MIB = 1024 * 1024
# Metadata a call may carry: a bearer token of up to 16 KiB (the gateway's limit) plus the rest.
# Soft and hard limits are equal: between them gRPC refuses calls at random.
MAX_METADATA_BYTES = 32 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """How one service listens, drains and reports.

    Variables, with `<S>` the service name in capitals (GATEWAY, ENGINE, SAFETY, KVSTORE):
    `THERMOCLINE_<S>_HOST`, `_PORT`, `_METRICS_PORT` (0 turns /metrics off),
    `_MAX_MESSAGE_MB`, `_GRACE_S`, `_KEEPALIVE_S`, and the shared `THERMOCLINE_LOG_LEVEL` and
    `THERMOCLINE_SERVICE_TOKEN_FILE` (service_auth.py).
    """

    service: str
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    max_message_bytes: int = 16 * MIB
    grace_s: float = 30.0
    keepalive_s: float = 30.0
    log_level: str = "INFO"
    # What internal callers must present (service_auth.py); None: no check, on loopback only.
    service_token: ServiceToken | None = None
    # The gateway: its callers authenticate with JWTs, and its port takes no service token.
    is_public: bool = False

    def __post_init__(self) -> None:
        if not self.is_public:
            check_listener(self.service, self.host, self.service_token)
        if not 0 < self.port < 65536:
            raise ValueError(f"{self.service}: port {self.port} is outside 1..65535")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"{self.service}: metrics port {self.metrics_port} is outside 0..65535")
        if self.max_message_bytes < 1024:
            raise ValueError(f"{self.service}: max message size {self.max_message_bytes} B is too small")
        if self.grace_s < 0:
            raise ValueError(f"{self.service}: grace period must be >= 0 s, got {self.grace_s}")

    @property
    def address(self) -> str:
        """host:port to bind."""
        return f"{self.host}:{self.port}"

    @classmethod
    def from_env(
        cls,
        service: str,
        default_port: int,
        environ: Mapping[str, str] | None = None,
        *,
        is_public: bool = False,
    ) -> ServerConfig:
        """Reads the settings of `service` from the environment."""
        prefix = f"{env.PREFIX}{service.upper()}_"
        return cls(
            service=service,
            host=env.get_str(prefix + "HOST", "127.0.0.1", environ),
            port=env.get_int(prefix + "PORT", default_port, environ),
            metrics_port=env.get_int(prefix + "METRICS_PORT", 0, environ),
            max_message_bytes=env.get_int(prefix + "MAX_MESSAGE_MB", 16, environ) * MIB,
            grace_s=env.get_float(prefix + "GRACE_S", 30.0, environ),
            keepalive_s=env.get_float(prefix + "KEEPALIVE_S", 30.0, environ),
            log_level=env.get_str(env.PREFIX + "LOG_LEVEL", "INFO", environ),
            service_token=token_from_env(environ),
            is_public=is_public,
        )


def channel_options(max_message_bytes: int = 16 * MIB, keepalive_s: float = 30.0) -> list[tuple[str, int]]:
    """gRPC options shared by servers and client channels: message and metadata limits, keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
