"""The engine's Prometheus metrics observed in the request path: queue wait, batch sizes, latencies.

A leaf module (no engine imports) so that the engine loop and the scheduler can observe into it
without importing the scrape-time collectors in `services/engine/serving/engine_metrics.py`.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

QUEUE_WAIT = Histogram(
    "thermocline_engine_queue_wait_seconds",
    "Time from arrival to admission, by intent class.",
    ["intent_class"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600),
)
# Per-request latencies, observed by the servicer when a request ends (serving/request_trace.py).
TIME_TO_FIRST_TOKEN = Histogram(
    "thermocline_engine_time_to_first_token_seconds",
    "Time from arrival in the engine to the first sampled token, by intent class.",
    ["intent_class"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "thermocline_engine_time_per_output_token_seconds",
    "Mean time between output tokens after the first, per request, by intent class.",
    ["intent_class"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
)
REQUEST_LATENCY = Histogram(
    "thermocline_engine_request_latency_seconds",
    "End-to-end time in the engine, arrival to the last token, by intent class.",
    ["intent_class"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
)
REQUESTS = Counter(
    "thermocline_engine_requests",
    "Requests the engine finished, by intent class and finish reason.",
    ["intent_class", "finish_reason"],
)
BATCH_SIZE = Histogram(
    "thermocline_engine_batch_sequences",
    "Sequences in each forward step, by row kind: prompt chunks (prefill) and decode rows (a mixed "
    "step observes both).",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
# The cold tier (kvstore): observed on the engine thread when a kvstore call's outcome is taken.
COLD_DEGRADATIONS = Counter(
    "thermocline_engine_kv_cold_degradations",
    "kvstore calls that gave nothing, so requests fell back to hot + warm, by operation and reason "
    "(unavailable, deadline, corrupt, error; dropped: a write with no room to wait for the store).",
    ["operation", "reason"],
)
COLD_BLOCKS = Counter(
    "thermocline_engine_kv_cold_blocks",
    "Blocks moved to or from the kvstore, by operation (store_prefix, load_prefix, demote, load_window).",
    ["operation"],
)
