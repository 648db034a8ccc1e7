"""The kvstore's settings, read from `THERMOCLINE_KVSTORE_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.config import ServerConfig

DEFAULT_PORT = 50054


@dataclass(frozen=True)
class KVStoreConfig:
    """Where the cold tier keeps its segment files and how much it may hold.

    `THERMOCLINE_KVSTORE_DATA_DIR` (default ./var/kvstore) and `THERMOCLINE_KVSTORE_CAPACITY_GB`.
    """

    server: ServerConfig
    data_dir: Path
    capacity_bytes: int
    redis_url: str

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"kvstore capacity must be positive, got {self.capacity_bytes} B")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVStoreConfig:
        """Reads the kvstore's settings."""
        return cls(
            server=ServerConfig.from_env("kvstore", DEFAULT_PORT, environ),
            data_dir=Path(env.get_str("THERMOCLINE_KVSTORE_DATA_DIR", "var/kvstore", environ)),
            capacity_bytes=int(env.get_float("THERMOCLINE_KVSTORE_CAPACITY_GB", 64.0, environ) * 1024**3),
            redis_url=env.redis_url(environ),
        )
