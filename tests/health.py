"""Waiting on a service's gRPC health, for tests that start real processes."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def watch_until(channel: grpc.Channel, service: str, status: int, timeout_s: float) -> bool:
    """Follows the health Watch stream for `service` until it reports `status`; whether it did
    within `timeout_s`."""
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        for reply in health_pb2_grpc.HealthStub(channel).Watch(request, timeout=timeout_s):
            if reply.status == status:
                return True
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    return False
