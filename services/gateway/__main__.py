"""`python -m services.gateway`: runs the gateway."""

from __future__ import annotations

from services.common.interceptors import CallTracker
from services.common.server import ServiceSpec, run_service
from services.gateway.config import GatewayConfig
from services.gateway.gateway import Gateway


def main() -> None:
    """Starts the gateway with settings from the environment."""
    config = GatewayConfig.from_env()
    built: list[Gateway] = []
    http_calls = CallTracker(gauge=None)  # the HTTP front's, which the drain waits on too

    def register(server: object) -> list[str]:
        gateway = Gateway(config, http_calls)  # built inside the server's event loop
        built.append(gateway)
        return gateway.register(server)  # type: ignore[arg-type]

    async def start() -> None:
        await built[0].start()

    async def stop() -> None:
        await built[0].close()

    async def cut_streams() -> None:
        built[0].servicer.in_flight.cut_all()

    spec = ServiceSpec(
        config=config.server,
        register=register,
        on_start=start,
        on_stop=stop,
        on_grace_over=cut_streams,
        other_calls=[http_calls],
        # no engine replica serves, none takes our service token, or safety refuses it: live, but
        # no traffic, with the reason /ready gives
        readiness_probe=lambda: built[0].upstreams.readiness_problem(),
        # No HTTP/2 window growth (BDP probing) on the public port: with it, the window grows to
        # megabytes and an oversized message is mostly read before it is refused. Without it, a
        # refused 10 MiB message cost ~3 ms of gateway CPU instead of ~12 ms, and a flood of them
        # held another caller's p99 within 2x of idle (bench/results/gateway_flood_2026-12-01_
        # cheap-refusal.md). The cost: a large message over a long-latency link takes more round
        # trips, and the gateway's messages are small (at most _MAX_PROMPT_BYTES plus 128 KiB).
        # A bound on one connection's streams: streams that never reach a handler (headers and part
        # of a message, no token) cost memory and nothing else, and 2,000 of them on each of 6
        # connections took the gateway from 385 MB to 975 MB. It stays above the gateway's own
        # stream cap, so a caller past that cap is refused with pushback rather than queued by its
        # HTTP/2 client. Connections idle for 5 minutes are closed. A cap on connections needs a
        # proxy in front.
        server_options=[
            ("grpc.http2.bdp_probe", 0),
            ("grpc.max_concurrent_streams", max(2 * config.limits.max_concurrent_streams, 100)),
            ("grpc.max_connection_idle_ms", 300_000),
        ],
    )
    run_service(spec)


if __name__ == "__main__":
    main()
