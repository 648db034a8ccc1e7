"""Choosing an engine replica: prefix affinity, queue-depth balancing, failover on NOT_SERVING.

Affinity is rendezvous (highest-random-weight) hashing of the tenant and the prompt's first
`prefix_chars` characters over the replicas that are ready: the same prefix lands on the same
replica, where its KV blocks are likely still cached, and when a replica leaves only its own
prefixes move. Each replica's health is followed through two Watch streams: the server's ""
(liveness) and the engine service's name (readiness, NOT_SERVING e.g. while its safety gate
refuses every Generate; an older engine that does not know the name counts as ready). A replica
that starts draining (both NOT_SERVING) stops receiving new requests at once, one that is live
but not ready gets none while another is ready, and one that comes back is used as soon as its
Watch says SERVING (the Watch waits for the connection, whose reconnect backoff is capped at
0.5 s in services/common/channels.py). When no replica is ready the live ones still get traffic,
so a caller gets their refusal (FAILED_PRECONDITION naming the gate), which says what to fix,
not UNAVAILABLE. Each replica's queue depth (running plus waiting, from GetStats) is polled.
GetStats carries the mesh's service token, where the health Watch needs none: a replica that
answers it UNAUTHENTICATED reads another token than this gateway (THERMOCLINE_SERVICE_TOKEN_FILE),
so it counts as not serving (the gateway's /ready with it) and gets no traffic while another
takes the token, until a later poll is answered; the operator hears of it in an ERROR and in
thermocline_gateway_upstream_token_refused_seconds (services/gateway/metrics.py).
Balancing is intent-aware: when the affinity replica's queue is more than `max_queue_skew`
longer than the shortest, latency-sensitive classes go to the shortest queue, while the `batch`
class tolerates four times the skew to keep its prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import telemetry
from services.common.channels import open_channel
from services.common.service_auth import TOKEN_FILE_SETTING
from services.gateway.config import RoutingConfig
from services.gateway.metrics import TokenHealth
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

BATCH_CLASS = "batch"
_BATCH_SKEW_FACTOR = 4
_RECONNECT_S = 0.5
ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
# An engine from before readiness knows only "": its health server answers SERVICE_UNKNOWN.
_READY_STATUSES = (_SERVING, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


class Replica:
    """One engine replica: its stub, whether it is live, ready and takes our service token, and its
    last known queue depth."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = open_channel(target, trace_calls=False)  # the stub traces its own calls
        service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
        self.stub = telemetry.traced_stub(engine_pb2_grpc.EngineServiceStub(self.channel), service)
        self.is_live = False  # "" is SERVING
        self.is_ready = False  # the engine service's name is SERVING (or unknown to the replica)
        self.token = TokenHealth("engine", target)  # refused: its last GetStats was UNAUTHENTICATED
        self.queue_depth = 0
        self._live = asyncio.Event()

    @property
    def is_serving(self) -> bool:
        """Live, and taking our service token: one that refuses it answers health checks only."""
        return self.is_live and not self.token.is_refused

    def affinity(self, key: bytes) -> int:
        """This replica's rendezvous weight for `key`."""
        digest = hashlib.blake2b(key + b"\x00" + self.target.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    async def follow_health(self) -> None:
        """Keeps `is_live` and `is_ready` current from the replica's health Watch streams, forever."""
        await asyncio.gather(self._follow("", self._set_live), self._follow(ENGINE_SERVICE, self._set_ready))

    async def _follow(self, service: str, update: Callable[[bool], None]) -> None:
        """Follows `service`'s health Watch, reconnecting forever; `update` gets whether it counts."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=service)
        is_up = _READY_STATUSES if service else (_SERVING,)
        while True:
            try:
                # wait_for_ready: while the replica is away the Watch waits for the connection
                # instead of failing, and its first reply arrives as soon as the replica is back
                async for reply in stub.Watch(request, wait_for_ready=True):
                    update(reply.status in is_up)
            except grpc.aio.AioRpcError:
                pass
            update(False)
            await asyncio.sleep(_RECONNECT_S)

    def _set_ready(self, is_ready: bool) -> None:
        if is_ready != self.is_ready:
            log.info("engine %s is %s", self.target, "ready" if is_ready else "not ready")
        self.is_ready = is_ready

    def _set_live(self, is_live: bool) -> None:
        if is_live != self.is_live:
            log.info("engine %s is %s", self.target, "SERVING" if is_live else "NOT_SERVING")
        self.is_live = is_live
        if is_live:
            self._live.set()
        else:
            self._live.clear()

    async def wait_serving(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the health Watch to report SERVING; whether it did."""
        try:
            await asyncio.wait_for(self._live.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def poll_stats(self, timeout_s: float) -> None:
        """Refreshes the queue depth and whether the replica takes our service token; keeps the old
        depth when the replica does not answer."""
        try:
            stats = await self.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                self.token.record_refusal()
            return
        self.token.record_accepted()
        self.queue_depth = int(stats.num_running + stats.num_waiting)


NOT_SERVING_YET = "no engine replica is serving yet; wait for the engines' health checks"
TOKEN_REFUSED = (
    "no engine replica accepts this gateway's service token: a configuration fault that the operator "
    f"must fix, which waiting will not mend; check that {TOKEN_FILE_SETTING} names the same token on "
    "this gateway and on its engines (the gateway's log names each replica that refuses it)"
)


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
            # the live ones: a replica refusing our token is asked again, to see it take it
            await asyncio.gather(*(r.poll_stats(interval) for r in self.replicas if r.is_live))
            await asyncio.sleep(interval)

    def candidates(self, key: bytes, priority_class: str) -> list[Replica]:
        """Replicas to try in order: the chosen one first, then the rest by affinity."""
        ranked = sorted(self.routable(), key=lambda r: r.affinity(key), reverse=True)
        skew = self.config.max_queue_skew * (_BATCH_SKEW_FACTOR if priority_class == BATCH_CLASS else 1)
        shortest = min(ranked, key=lambda r: r.queue_depth)
        if ranked[0].queue_depth - shortest.queue_depth > skew:
            ranked.remove(shortest)
            ranked.insert(0, shortest)
        return ranked

    def readiness_problem(self) -> str | None:
        """The engines' part of why the gateway should get no traffic now, or None while a replica
        serves; Upstreams.readiness_problem adds the safety service's, and /ready and the gRPC
        readiness both answer that. It names no replica, as /ready answers anyone."""
        if any(r.is_serving for r in self.replicas):
            return None
        if any(r.is_live for r in self.replicas):  # live, and each one refuses our token
            return TOKEN_REFUSED
        return NOT_SERVING_YET

    def routable(self) -> list[Replica]:
        """The ready replicas; else the serving ones (their refusal says why); else the live ones,
        which refuse our token (the caller hears that no usable engine is reachable); else all."""
        live = [r for r in self.replicas if r.is_live]
        serving = [r for r in live if r.is_serving]
        return [r for r in serving if r.is_ready] or serving or live or list(self.replicas)

    def by_preference(self) -> list[Replica]:
        """Every replica, the order a call that any of them can answer tries them in: the ready
        ones, then the serving ones, then the live ones, then the rest (as `routable` falls back)."""
        return sorted(self.replicas, key=lambda r: (not r.is_serving, not r.is_live, not r.is_ready))

    def any_routable(self) -> Replica:
        """The replica such a call goes to first: ready, else serving, else live, else the first one."""
        return self.by_preference()[0]

    async def close(self) -> None:
        """Stops the background tasks and closes the channels."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas:
            await replica.channel.close(grace=None)
