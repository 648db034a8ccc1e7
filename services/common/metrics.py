"""Prometheus metrics every service exports, and the /metrics endpoint."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, start_http_server

log = logging.getLogger(__name__)

# The `_created` series double every metric and no dashboard here reads them.
disable_created_metrics()

RPC_HANDLED = Counter(
    "thermocline_rpc_server_handled_total",
    "RPCs finished by this server, by method and gRPC status code.",
    ["method", "code"],
)
RPC_DURATION = Histogram(
    "thermocline_rpc_server_duration_seconds",
    "Wall time of each RPC from arrival to its last message.",
    ["method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
RPC_IN_FLIGHT = Gauge("thermocline_rpc_server_in_flight_requests", "RPCs being served now.")
DRAINING = Gauge("thermocline_server_draining", "1 while the server drains after SIGTERM, else 0.")


def start_metrics_server(host: str, port: int) -> None:
    """Serves /metrics on host:port in a background thread; port 0 turns it off."""
    if port == 0:
        return
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
