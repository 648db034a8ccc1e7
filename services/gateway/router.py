"""Choosing an engine replica: prefix affinity, queue-depth balancing, failover on NOT_SERVING.

Affinity is rendezvous (highest-random-weight) hashing of the tenant and the prompt's first
`prefix_chars` characters over the replicas that are serving: the same prefix lands on the same
replica, where its KV blocks are likely still cached, and when a replica leaves only its own
prefixes move. Each replica's health is followed through its Watch stream, so a replica that
starts draining (NOT_SERVING) stops receiving new requests at once, and one that comes back is
used as soon as its Watch says SERVING (the Watch waits for the connection, whose reconnect
backoff is capped at 0.5 s in services/common/channels.py); its queue depth (running plus
waiting, from GetStats) is polled. Balancing is intent-aware: when the affinity replica's
queue is more than `max_queue_skew` longer than the shortest, latency-sensitive classes go to
the shortest queue, while the `batch` class tolerates four times the skew to keep its prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import telemetry
from services.common.channels import open_channel
from services.gateway.config import RoutingConfig
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

BATCH_CLASS = "batch"
_BATCH_SKEW_FACTOR = 4
_RECONNECT_S = 0.5


class Replica:
    """One engine replica: its stub, whether it serves, and its last known queue depth."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = open_channel(target, trace_calls=False)  # the stub traces its own calls
        service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
        self.stub = telemetry.traced_stub(engine_pb2_grpc.EngineServiceStub(self.channel), service)
        self.is_serving = False
        self.queue_depth = 0
        self._serving = asyncio.Event()

    def affinity(self, key: bytes) -> int:
        """This replica's rendezvous weight for `key`."""
        digest = hashlib.blake2b(key + b"\x00" + self.target.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    async def follow_health(self) -> None:
        """Keeps `is_serving` current from the replica's health Watch stream, reconnecting forever."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                # wait_for_ready: while the replica is away the Watch waits for the connection
                # instead of failing, and its first reply arrives as soon as the replica is back
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True):
                    self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            self._set_serving(False)
            await asyncio.sleep(_RECONNECT_S)

    def _set_serving(self, is_serving: bool) -> None:
        if is_serving != self.is_serving:
            log.info("engine %s is %s", self.target, "SERVING" if is_serving else "NOT_SERVING")
        self.is_serving = is_serving
        if is_serving:
            self._serving.set()
        else:
            self._serving.clear()

    async def wait_serving(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the health Watch to report SERVING; whether it did."""
        try:
            await asyncio.wait_for(self._serving.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def poll_stats(self, timeout_s: float) -> None:
        """Refreshes the queue depth; keeps the old value when the replica does not answer."""
        try:
            stats = await self.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return
        self.queue_depth = int(stats.num_running + stats.num_waiting)


def affinity_key(tenant: str, prompt_text: str, prefix_chars: int) -> bytes:
    """What affinity hashes: the tenant (its cache salt) and the start of the prompt."""
    return tenant.encode() + b"\x00" + prompt_text[:prefix_chars].encode()


class Router:
    """The replicas and the policy that orders them for one request."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.replicas = [Replica(target) for target in config.engine_targets]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Starts following health and polling stats of every replica."""
        self._tasks = [asyncio.create_task(r.follow_health()) for r in self.replicas]
        self._tasks.append(asyncio.create_task(self._poll_forever()))

    async def _poll_forever(self) -> None:
        interval = self.config.stats_interval_s
        while True:
            await asyncio.gather(*(r.poll_stats(interval) for r in self.replicas if r.is_serving))
            await asyncio.sleep(interval)

    def candidates(self, key: bytes, priority_class: str) -> list[Replica]:
        """Replicas to try in order: the chosen one first, then the rest by affinity."""
        serving = [r for r in self.replicas if r.is_serving] or list(self.replicas)
        ranked = sorted(serving, key=lambda r: r.affinity(key), reverse=True)
        skew = self.config.max_queue_skew * (_BATCH_SKEW_FACTOR if priority_class == BATCH_CLASS else 1)
        shortest = min(ranked, key=lambda r: r.queue_depth)
        if ranked[0].queue_depth - shortest.queue_depth > skew:
            ranked.remove(shortest)
            ranked.insert(0, shortest)
        return ranked

    def any_serving(self) -> Replica:
        """A serving replica (the first one when none is known to serve)."""
        return next((r for r in self.replicas if r.is_serving), self.replicas[0])

    async def close(self) -> None:
        """Stops the background tasks and closes the channels."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas:
            await replica.channel.close(grace=None)
