"""The kvstore's settings, read from `THERMOCLINE_KVSTORE_*` variables (docs/kvstore.md lists them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.config import MIB, ServerConfig
from services.kvstore.segments import FsyncPolicy

DEFAULT_PORT = 50054
GIB = 1024**3
KIB = 1024


@dataclass(frozen=True)
class StoreConfig:
    """How the block store keeps, bounds and serves its segments."""

    data_dir: Path
    capacity_bytes: int
    redis_url: str
    index_prefix: str = "thermocline:kvstore:"
    max_segment_bytes: int = 256 * MIB
    fsync_policy: FsyncPolicy = FsyncPolicy.BATCH
    fsync_batch_window_s: float = 0.002
    ttl_s: float = 7 * 24 * 3600.0
    staging_bytes: int = 512 * MIB
    num_prefetch_workers: int = 4
    max_block_bytes: int = 64 * MIB
    chunk_bytes: int = 1 * MIB
    max_hashes_per_call: int = 4096
    compact_live_ratio: float = 0.5
    maintenance_interval_s: float = 10.0
    # PutBlocks and GetBlocks served at once (each holds up to a block in memory: streams.py)
    max_streams: int = 32
    # a PutBlocks that sends nothing for this long is ended (DEADLINE_EXCEEDED)
    stream_idle_s: float = 30.0
    # Hand out record locations (LocateBlocks) so a caller on this host reads segments itself. Off by
    # default: the caller must see this store's data dir at the same path, and can then read every
    # tenant's records from the files; only the engine should be given that (docs/kvstore.md).
    serve_locations: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"kvstore capacity must be positive, got {self.capacity_bytes} B")
        if self.max_segment_bytes < 4096:
            raise ValueError(f"segments must be at least 4 KiB, got {self.max_segment_bytes} B")
        if not 0 <= self.fsync_batch_window_s <= 1:
            raise ValueError(f"the fsync batch window must be 0..1 s, got {self.fsync_batch_window_s}")
        if self.ttl_s < 0 or self.maintenance_interval_s <= 0:
            raise ValueError("the TTL must be >= 0 s (0: none) and the maintenance interval > 0 s")
        if not 0 < self.compact_live_ratio < 1:
            raise ValueError(f"the compaction live ratio must be in (0, 1), got {self.compact_live_ratio}")
        if self.chunk_bytes < KIB or self.num_prefetch_workers < 1 or self.max_hashes_per_call < 1:
            raise ValueError("chunks must be >= 1 KiB, and prefetch workers and hashes per call >= 1")
        if self.max_streams < 1 or self.stream_idle_s <= 0:
            raise ValueError(
                f"the kvstore needs max streams >= 1 and a stream idle limit > 0 s, got {self.max_streams} "
                f"and {self.stream_idle_s} s"
            )

    @property
    def segments_dir(self) -> Path:
        """Where the segment files live."""
        return self.data_dir / "segments"

    @property
    def secret_path(self) -> Path:
        """The tenant secret; back it up with the segments, or the blocks cannot be found again."""
        return self.data_dir / "tenant_secret"


@dataclass(frozen=True)
class KVStoreConfig:
    """The kvstore's server and store settings."""

    server: ServerConfig
    store: StoreConfig

    @property
    def data_dir(self) -> Path:
        """Where the store keeps its files."""
        return self.store.data_dir

    @property
    def capacity_bytes(self) -> int:
        """The configured bound on live bytes (the store keeps less where the disk holds less)."""
        return self.store.capacity_bytes

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVStoreConfig:
        """Reads the kvstore's settings."""
        server = ServerConfig.from_env("kvstore", DEFAULT_PORT, environ)
        return cls(server=server, store=_store_from_env(environ, server.max_message_bytes))


def _store_from_env(environ: Mapping[str, str] | None, max_message_bytes: int) -> StoreConfig:
    prefix = env.PREFIX + "KVSTORE_"
    policy = env.get_str(prefix + "FSYNC", "batch", environ)
    if policy not in FsyncPolicy._value2member_map_:
        raise env.EnvError(f"{prefix}FSYNC={policy!r} is not one of: batch, always")
    # a reply chunk plus its header must fit one gRPC message
    chunk_bytes = min(env.get_int(prefix + "CHUNK_KB", 1024, environ) * KIB, max_message_bytes - 64 * KIB)
    return StoreConfig(
        data_dir=Path(env.get_str(prefix + "DATA_DIR", "var/kvstore", environ)),
        capacity_bytes=int(env.get_float(prefix + "CAPACITY_GB", 64.0, environ) * GIB),
        redis_url=env.redis_url(environ),
        index_prefix=env.get_str(prefix + "INDEX_PREFIX", "thermocline:kvstore:", environ),
        max_segment_bytes=int(env.get_float(prefix + "SEGMENT_MB", 256.0, environ) * MIB),
        fsync_policy=FsyncPolicy(policy),
        fsync_batch_window_s=env.get_float(prefix + "FSYNC_BATCH_MS", 2.0, environ) / 1000,
        ttl_s=env.get_float(prefix + "TTL_S", 7 * 24 * 3600.0, environ),
        staging_bytes=int(env.get_float(prefix + "STAGING_MB", 512.0, environ) * MIB),
        num_prefetch_workers=env.get_int(prefix + "PREFETCH_WORKERS", 4, environ),
        max_block_bytes=int(env.get_float(prefix + "MAX_BLOCK_MB", 64.0, environ) * MIB),
        chunk_bytes=chunk_bytes,
        max_hashes_per_call=env.get_int(prefix + "MAX_HASHES", 4096, environ),
        compact_live_ratio=env.get_float(prefix + "COMPACT_LIVE_RATIO", 0.5, environ),
        maintenance_interval_s=env.get_float(prefix + "MAINTENANCE_S", 10.0, environ),
        serve_locations=env.get_bool(prefix + "SERVE_LOCATIONS", False, environ),
        max_streams=env.get_int(prefix + "MAX_STREAMS", 32, environ),
        stream_idle_s=env.get_float(prefix + "STREAM_IDLE_S", 30.0, environ),
    )
