"""What every RPC pays for the server interceptors that every service runs.

An aio server on loopback answers a unary call and a server-streaming call of `--messages`
messages, once without interceptors and once with the ones services/common/server.py installs
(the call's server span, the drain gate, error mapping and RPC metrics), with tracing set up as a
service sets it up without an OTLP endpoint (spans recorded, then dropped). The client runs in
the same process and event loop; what differs between the rows is the server's interceptors.
Calls alternate between the two servers, after a warm-up, and each row is the round trip of one
call as the client sees it.

    .venv/bin/python bench/server_interceptor.py --calls 3000

Run it from another checkout (cwd and PYTHONPATH there) to time that checkout's interceptors.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bench.gateway_overhead import percentile
from bench.machine import cpu_name, git_commit
from services.common import telemetry
from services.common.interceptors import CallTracker, GuardInterceptor

SERVICE = "thermocline.bench.Echo"
WARM_UP = 200


def interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The interceptors services/common/server.py installs, in this checkout."""
    if hasattr(telemetry, "server_interceptor"):  # before the guard opened the span itself
        return [telemetry.server_interceptor(), GuardInterceptor(CallTracker())]
    return [GuardInterceptor(CallTracker())]


async def start(chain: list[grpc.aio.ServerInterceptor], num_messages: int) -> tuple[grpc.aio.Server, int]:
    async def unary(request: bytes, context: Any) -> bytes:
        return request

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(num_messages):
            yield request

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),  # type: ignore[arg-type]
    }
    server = grpc.aio.server(interceptors=chain)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def measure(args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Round-trip ms per (call kind, server)."""
    servers = {
        "no interceptors": await start([], args.messages),
        "services' interceptors": await start(interceptors(), args.messages),
    }
    samples: dict[tuple[str, str], list[float]] = {}
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (_, port) in servers.items()}
    payload = b"x" * 64
    for index in range(WARM_UP + args.calls):
        for name, channel in channels.items():
            started = time.perf_counter()
            await channel.unary_unary(f"/{SERVICE}/Unary")(payload)
            unary_ms = (time.perf_counter() - started) * 1e3
            started = time.perf_counter()
            async for _ in channel.unary_stream(f"/{SERVICE}/Stream")(payload):
                pass
            stream_ms = (time.perf_counter() - started) * 1e3
            if index >= WARM_UP:
                samples.setdefault(("unary", name), []).append(unary_ms)
                samples.setdefault((f"stream of {args.messages}", name), []).append(stream_ms)
    for channel in channels.values():
        await channel.close(None)
    for server, _ in servers.values():
        await server.stop(None)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=16)
    args = parser.parse_args()
    telemetry.setup_tracing("bench")
    samples = asyncio.run(measure(args))
    print("# What the services' server interceptors cost a call\n")
    print(
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {git_commit()}; "
        f"checkout: {os.getcwd()}"
    )
    print(
        f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs; "
        f"Python {platform.python_version()}, grpcio {grpc.__version__}"
    )
    print(f"- settings: {args.calls} calls of each kind per server, alternating, after {WARM_UP} warm-up\n")
    print("| call | server | p50 ms | p90 ms | p99 ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (kind, name), values in samples.items():
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        print(f"| {kind} | {name} | {p50:.3f} | {p90:.3f} | {p99:.3f} |")


if __name__ == "__main__":
    main()
