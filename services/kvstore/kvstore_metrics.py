"""The kvstore's Prometheus metrics: the cold tier's traffic, latency, errors and occupancy.

The store fills them: bytes after each fsynced write or checksummed read, one latency sample per
operation, and an error for each corrupt record or failed maintenance pass.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OPERATIONS = ("put", "get", "lookup", "locate", "prefetch", "delete", "compact")

READ_BYTES = Counter("thermocline_kvstore_read_bytes", "Block payload bytes read from segment files.")
WRITTEN_BYTES = Counter(
    "thermocline_kvstore_written_bytes", "Block payload bytes written to segment files and fsynced."
)
OPERATION_DURATION = Histogram(
    "thermocline_kvstore_operation_duration_seconds",
    "Time per store operation (one block put or get, one lookup batch, ...), by operation.",
    ["operation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
ERRORS = Counter(
    "thermocline_kvstore_errors",
    "Store failures by operation: corrupt or truncated records, I/O errors, index errors.",
    ["operation"],
)
BLOCK_LOOKUPS = Counter(
    "thermocline_kvstore_block_lookups", "Blocks asked for by hash, by result (hit or miss).", ["result"]
)
STORED_BYTES = Gauge("thermocline_kvstore_stored_bytes", "Bytes held in live segment records.")
OPEN_STREAMS = Gauge(
    "thermocline_kvstore_open_stream_requests", "Block streams being served, by RPC (put, get).", ["rpc"]
)
STREAMS_REFUSED = Counter(
    "thermocline_kvstore_streams_refused",
    "Block streams refused because THERMOCLINE_KVSTORE_MAX_STREAMS were open, by RPC (put, get).",
    ["rpc"],
)
CAPACITY_BYTES = Gauge(
    "thermocline_kvstore_capacity_bytes",
    "Live bytes the store keeps before evicting: the configured capacity, or less where the disk holds less.",
)


def init_kvstore_metrics(capacity_bytes: int) -> None:
    """Sets the capacity and creates every labelled series at zero, so rates exist before traffic."""
    CAPACITY_BYTES.set(capacity_bytes)
    for operation in OPERATIONS:
        OPERATION_DURATION.labels(operation)
        ERRORS.labels(operation)
    for result in ("hit", "miss"):
        BLOCK_LOOKUPS.labels(result)
    for rpc in ("put", "get"):
        OPEN_STREAMS.labels(rpc)
        STREAMS_REFUSED.labels(rpc)
