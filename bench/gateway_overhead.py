"""Gateway overhead on loopback: TTFT through the gateway (gRPC and HTTP) vs straight to the engine,
relay throughput, and TTFT per output release policy.

    .venv/bin/python bench/gateway_overhead.py                      # every part, writes bench/results/
    .venv/bin/python bench/gateway_overhead.py --requests 50 --no-write
    .venv/bin/python bench/gateway_overhead.py --parts release --release-requests 40 --tag release

Part 1 starts the real mesh (redis-server, safety, engine with stories260K, gateway) and times the
first token of `--requests` sequential one-token requests, rotating through direct engine calls,
gateway gRPC calls and streaming calls to the gateway's OpenAI-compatible HTTP front (a raw
HTTP/1.1 client on a fresh loopback connection, timed to the first `data:` event); the gateway
path includes JWT, RBAC, intent, token count, the Redis rate limit, the fsynced audit event, the
safety prompt check and the output check. Part 2 replaces the engine with
a fixed-rate token source (a test double, allowed only in this benchmark) and measures how many
streams and tokens per second one gateway process relays to `--streams` concurrent clients.

Part 3 (`release`) puts one gateway per output release policy (strict, growing, trailing; see
services/gateway/output_screen.py) in front of the same engine and safety service, and times the
first streamed token of `--release-max-tokens`-token requests through each, interleaved with a
direct engine stream that records when its 1st, `--first-window-tokens`th and `--check-tokens`th
tokens arrive, and with direct safety checks of the prompt and of the first windows' text. So each
policy's TTFT splits into: the engine's time to the token the policy waits for, the screens on the
path (as the safety service answers them directly), and the rest, which is the gateway's own. It
runs once on stories260K and once on the fixed-rate source at `--release-tpot-ms` per token, a
stand-in for a model whose decode step is as slow as a real one's on this CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name, default_engine_device  # noqa: E402
from services.cli.client import build_request, call_metadata  # noqa: E402
from services.cli.mesh import Mesh, MeshConfig, Ports, free_port  # noqa: E402
from services.common.channels import wait_until_serving  # noqa: E402
from services.common.service_auth import ServiceToken, authenticated_aio, read_token  # noqa: E402
from services.engine.model.registry import resolve_model  # noqa: E402
from services.gateway.tokens import mint_token  # noqa: E402
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from thermocline.gateway.v1 import gateway_pb2_grpc  # noqa: E402
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc  # noqa: E402

PROMPT = "Once upon a time"
NUM_WARMUP = 10  # requests per path before the samples that count
RELEASE_POLICIES = ("strict", "growing", "trailing")
HIGH_LIMITS = {
    "defaults": {"requests_per_s": 1e6, "burst_requests": 10**6, "tokens_per_min": 10**12, "max_streams": 0}
}


class FixedRateEngine(engine_pb2_grpc.EngineServiceServicer):
    """A token source: `max_tokens` tokens at a fixed interval, no model. Benchmark use only."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[engine_pb2.GenerateResponse]:
        num_tokens = request.sampling.max_tokens or 16
        for index in range(num_tokens):
            await asyncio.sleep(self.interval_s)
            is_last = index == num_tokens - 1
            message = engine_pb2.GenerateResponse(token_ids=[300 + index % 100], text=" tok")
            if is_last:
                message.finish_reason = engine_pb2.FINISH_REASON_LENGTH
                message.usage.prompt_tokens, message.usage.completion_tokens = 5, num_tokens
            yield message

    async def GetStats(self, request: Any, context: Any) -> engine_pb2.GetStatsResponse:
        return engine_pb2.GetStatsResponse(max_batch_size=1024, device="fake")

    async def GetModelInfo(self, request: Any, context: Any) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(model="fixed-rate", max_context_tokens=1 << 20)

    async def CountTokens(self, request: Any, context: Any) -> engine_pb2.CountTokensResponse:
        return engine_pb2.CountTokensResponse(num_tokens=5, model="fixed-rate")


async def serve_fake_engine(port: int, interval_s: float) -> None:
    """Runs the fixed-rate source until killed."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(FixedRateEngine(interval_s), server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def start_mesh(state_dir: Path, model: str, otlp_endpoint: str | None = None, **env: str) -> Mesh:
    """A mesh with high tenant limits, so the benchmark measures work, not refusals; its spans go
    to `otlp_endpoint` when one is given."""
    tenants = state_dir / "tenants.json"
    tenants.parent.mkdir(parents=True, exist_ok=True)
    tenants.write_text(json.dumps(HIGH_LIMITS))
    settings = {"THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants), "THERMOCLINE_LOG_LEVEL": "WARNING", **env}
    # The mesh passes none of its caller's THERMOCLINE_* settings on; this one it must, or the
    # engine's device would not be the one the results name (bench.machine.default_engine_device).
    if device := os.environ.get("THERMOCLINE_ENGINE_DEVICE"):
        settings.setdefault("THERMOCLINE_ENGINE_DEVICE", device)
    config = MeshConfig(
        model=model, state_dir=state_dir, ports=Ports.free(), env=settings, otlp_endpoint=otlp_endpoint
    )
    mesh = Mesh(config)
    mesh.start()
    return mesh


async def first_token_s(stub: Any, request: Any, metadata: list[tuple[str, str]]) -> float:
    """Seconds from call to the first streamed message (the stream is then read to its end)."""
    started = time.perf_counter()
    call = stub.Generate(request, metadata=metadata, timeout=60)
    await call.read()
    elapsed = time.perf_counter() - started
    while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
        pass
    return elapsed


async def http_first_event_s(url: str, token: str) -> float:
    """Seconds from connecting to the first SSE `data:` line of a streaming completion."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    body = json.dumps({"model": "", "prompt": PROMPT, "max_tokens": 1, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.encode() + body)
    while not (line := await reader.readline()).startswith(b"data: "):
        if not line:
            raise RuntimeError("the HTTP front closed the stream before its first event")
    elapsed = time.perf_counter() - started
    await reader.read()  # to the end of the stream
    writer.close()
    return elapsed


async def measure_ttft(mesh: Mesh, num_requests: int) -> dict[str, list[float]]:
    """TTFT samples, direct, through the gateway's gRPC and through its HTTP front, interleaved."""
    token = mint_token(mesh.private_key_path.read_bytes(), subject="bench", tenant="bench")
    engine_request = engine_pb2.GenerateRequest(
        prompt=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=1)
    )
    gateway_request = build_request(PROMPT, max_tokens=1)
    samples: dict[str, list[float]] = {"engine direct": [], "through gateway": [], "through HTTP front": []}
    async with (
        grpc.aio.insecure_channel(mesh.target("engine")) as engine_channel,
        grpc.aio.insecure_channel(mesh.target("gateway")) as gateway_channel,
    ):
        # The engine serves the mesh's services alone: the direct calls carry its service token.
        service = read_token(mesh.service_token_path)
        engine = engine_pb2_grpc.EngineServiceStub(authenticated_aio(engine_channel, service))
        gateway = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
        for index in range(NUM_WARMUP + num_requests):
            direct = await first_token_s(engine, engine_request, [])
            relayed = await first_token_s(gateway, gateway_request, call_metadata(token))
            over_http = await http_first_event_s(mesh.http_url(), token)
            if index >= NUM_WARMUP:
                samples["engine direct"].append(direct)
                samples["through gateway"].append(relayed)
                samples["through HTTP front"].append(over_http)
    return samples


async def measure_relay(
    target: str, token: str, num_streams: int, tokens_per_stream: int, duration_s: float
) -> dict[str, float]:
    """Streams and tokens per second relayed to `num_streams` concurrent looping clients."""
    request = build_request(PROMPT, max_tokens=tokens_per_stream)
    metadata = call_metadata(token)
    counts = {"streams": 0, "tokens": 0, "errors": 0}
    stop_at = time.perf_counter() + duration_s

    async def client(stub: Any) -> None:
        while time.perf_counter() < stop_at:
            try:
                async for message in stub.Generate(request, metadata=metadata, timeout=60):
                    counts["tokens"] += len(message.delta.token_ids)
                counts["streams"] += 1
            except grpc.aio.AioRpcError:
                counts["errors"] += 1

    started = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(num_streams)))
    elapsed = time.perf_counter() - started
    return {
        "streams_per_s": counts["streams"] / elapsed,
        "tokens_per_s": counts["tokens"] / elapsed,
        "errors": counts["errors"],
        "elapsed_s": elapsed,
    }


def relay_part(args: argparse.Namespace, state_dir: Path) -> list[dict[str, float]]:
    """Part 2: one gateway in front of the fixed-rate source."""
    port = free_port()
    source = subprocess.Popen(
        [sys.executable, __file__, "--fake-engine", str(port), "--interval-ms", str(args.interval_ms)]
    )
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", 30))
        mesh = start_mesh(
            state_dir,
            str(resolve_model("stories260k")),
            THERMOCLINE_GATEWAY_ENGINE_TARGETS=f"127.0.0.1:{port}",
            THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS="100000",
            THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS=str(args.check_tokens),
        )
        with mesh:
            token = mint_token(mesh.private_key_path.read_bytes(), subject="bench", tenant="bench")
            rows = []
            for num_streams in args.streams:
                result = asyncio.run(
                    measure_relay(
                        mesh.target("gateway"), token, num_streams, args.tokens_per_stream, args.duration_s
                    )
                )
                rows.append({"num_streams": num_streams, **result})
                print(f"relay {num_streams} streams: {result}", flush=True)
            return rows
    finally:
        source.kill()
        source.wait()


async def token_times_s(
    stub: Any, request: Any, metadata: list[tuple[str, str]], num_tokens: int
) -> list[float]:
    """Seconds from call to the arrival of each of the first `num_tokens` tokens; then cancels."""
    started = time.perf_counter()
    call = stub.Generate(request, metadata=metadata, timeout=60)
    times: list[float] = []
    while len(times) < num_tokens:
        message = await call.read()
        if message is grpc.aio.EOF:  # type: ignore[attr-defined]
            raise RuntimeError(f"the stream ended after {len(times)} of {num_tokens} tokens")
        ids = message.delta.token_ids if hasattr(message, "delta") else message.token_ids
        times += [time.perf_counter() - started] * len(ids)
    call.cancel()
    return times[:num_tokens]


async def first_delta_s(stub: Any, request: Any, metadata: list[tuple[str, str]]) -> float:
    """Seconds from call to the first message carrying tokens; then cancels."""
    return (await token_times_s(stub, request, metadata, 1))[0]


async def check_s(safety: Any, layer: str, text: str) -> float:
    """Seconds one direct safety check of `text` takes."""
    started = time.perf_counter()
    if layer == "prompt":
        await safety.CheckPrompt(safety_pb2.CheckPromptRequest(text=text, tenant="bench"), timeout=30)
    else:
        await safety.CheckOutput(safety_pb2.CheckOutputRequest(text=text, tenant="bench"), timeout=30)
    return time.perf_counter() - started


async def window_texts(engine: Any, request: Any, sizes: tuple[int, ...]) -> dict[int, str]:
    """The text of the first n tokens of the completion, for each n in `sizes`."""
    texts, text, num_tokens = {}, "", 0
    async for message in engine.Generate(request, timeout=60):
        text, num_tokens = text + message.text, num_tokens + len(message.token_ids)
        texts |= {n: text for n in sizes if n == num_tokens}
    return texts


def release_paths(args: argparse.Namespace) -> dict[str, tuple[int, str]]:
    """Per policy: the token the first release waits for, and which output window is screened
    before it ("" for none)."""
    first, window = args.first_window_tokens, args.check_tokens
    return {"strict": (window, str(window)), "growing": (first, str(first)), "trailing": (1, "")}


async def measure_release(
    args: argparse.Namespace,
    engine_target: str,
    gateways: dict[str, str],
    safety_target: str,
    token: str,
    service: ServiceToken,
) -> dict[str, list[float]]:
    """Interleaved samples: direct engine token times, each policy's TTFT, direct safety checks."""
    engine_request = engine_pb2.GenerateRequest(
        prompt=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=args.release_max_tokens)
    )
    gateway_request = build_request(PROMPT, max_tokens=args.release_max_tokens)
    sizes = (args.first_window_tokens, args.check_tokens)
    samples: dict[str, list[float]] = {}
    async with (
        grpc.aio.insecure_channel(engine_target) as engine_channel,
        grpc.aio.insecure_channel(safety_target) as safety_channel,
    ):
        engine = engine_pb2_grpc.EngineServiceStub(authenticated_aio(engine_channel, service))
        safety = safety_pb2_grpc.SafetyServiceStub(authenticated_aio(safety_channel, service))
        texts = await window_texts(engine, engine_request, sizes)
        channels = {p: grpc.aio.insecure_channel(t) for p, t in gateways.items()}
        stubs = {p: gateway_pb2_grpc.GatewayServiceStub(c) for p, c in channels.items()}
        for index in range(NUM_WARMUP + args.release_requests):
            row = {}
            times = await token_times_s(engine, engine_request, [], max(sizes))
            row |= {f"engine token {n}": times[n - 1] for n in (1, *sizes)}
            for policy, stub in stubs.items():
                row[f"gateway {policy}"] = await first_delta_s(stub, gateway_request, call_metadata(token))
            row["screen prompt"] = await check_s(safety, "prompt", PROMPT)
            for n in sizes:
                row[f"screen output {n}"] = await check_s(safety, "output", texts[n])
            if index >= NUM_WARMUP:
                for name, value in row.items():
                    samples.setdefault(name, []).append(value)
        for channel in channels.values():
            await channel.close()
    return samples


def release_rows(args: argparse.Namespace, samples: dict[str, list[float]]) -> list[str]:
    """Per policy: TTFT, the engine's time to the awaited token, the screens, the critical path
    they make, and the gateway's own share (TTFT minus that path), all paired per round."""
    lines = [
        "| policy | first release after | gateway TTFT p50 / p99 ms | engine to that token p50 ms "
        "| screens p50 ms | engine and screens on the path p50 ms | gateway's own p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    prompt = [v * 1000 for v in samples["screen prompt"]]
    for policy, (waits_for, window) in release_paths(args).items():
        ttft = [v * 1000 for v in samples[f"gateway {policy}"]]
        engine = [v * 1000 for v in samples[f"engine token {waits_for}"]]
        if window:  # prompt screen, then the engine, then the first window's screen
            output = [v * 1000 for v in samples[f"screen output {window}"]]
            screens = [a + b for a, b in zip(prompt, output, strict=True)]
            path = [e + s for e, s in zip(engine, screens, strict=True)]
            after = f"{waits_for} token(s) + output screen of {window}"
        else:  # trailing: the prompt screen runs alongside prefill
            screens = prompt
            path = [max(e, s) for e, s in zip(engine, screens, strict=True)]
            after = "1 token and the prompt screen, side by side"
        own = [t - c for t, c in zip(ttft, path, strict=True)]
        lines.append(
            f"| {policy} | {after} | {percentile(ttft, 50):.1f} / {percentile(ttft, 99):.1f} "
            f"| {percentile(engine, 50):.1f} | {percentile(screens, 50):.1f} | {percentile(path, 50):.1f} "
            f"| {percentile(own, 50):.1f} / {percentile(own, 99):.1f} |"
        )
    engine_first = [v * 1000 for v in samples["engine token 1"]]
    lines.append(
        f"| (engine direct) | 1 token | {percentile(engine_first, 50):.1f} / "
        f"{percentile(engine_first, 99):.1f} | | | | |"
    )
    return lines


def start_release_gateways(mesh: Mesh, args: argparse.Namespace, suffix: str, **env: str) -> dict[str, str]:
    """One gateway process per release policy on `mesh`; returns their targets."""
    return {
        policy: mesh.start_gateway_replica(
            f"gateway-{policy}{suffix}",
            THERMOCLINE_GATEWAY_OUTPUT_RELEASE=policy,
            THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS=str(args.check_tokens),
            THERMOCLINE_GATEWAY_OUTPUT_FIRST_WINDOW_TOKENS=str(args.first_window_tokens),
            **env,
        )
        for policy in RELEASE_POLICIES
    }


def release_part(args: argparse.Namespace, state_dir: Path) -> dict[str, dict[str, list[float]]]:
    """Part 3: TTFT per release policy, on stories260K and on the fixed-rate source."""
    results = {}
    port = free_port()
    source = subprocess.Popen(
        [sys.executable, __file__, "--fake-engine", str(port), "--interval-ms", str(args.release_tpot_ms)]
    )
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", 30))
        with start_mesh(state_dir, str(resolve_model("stories260k"))) as mesh:
            token = mint_token(mesh.private_key_path.read_bytes(), subject="bench", tenant="bench")
            service = read_token(mesh.service_token_path)
            on_model = start_release_gateways(mesh, args, "")
            results["stories260K"] = asyncio.run(
                measure_release(args, mesh.target("engine"), on_model, mesh.target("safety"), token, service)
            )
            fake = f"127.0.0.1:{port}"
            on_source = start_release_gateways(mesh, args, "-fixed", THERMOCLINE_GATEWAY_ENGINE_TARGETS=fake)
            results[f"fixed-rate source, {args.release_tpot_ms:g} ms/token"] = asyncio.run(
                measure_release(args, fake, on_source, mesh.target("safety"), token, service)
            )
    finally:
        source.kill()
        source.wait()
    return results


def machine() -> dict[str, str]:
    """CPU, commit and versions for the results file."""
    cpu = cpu_name()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO
    ).stdout
    return {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "git commit": commit + (" (dirty tree)" if dirty.strip() else ""),
        "cpu": cpu,
        "logical cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def report(
    args: argparse.Namespace,
    ttft: dict[str, list[float]],
    relay: list[dict[str, float]],
    release: dict[str, dict[str, list[float]]],
) -> str:
    """The results as markdown."""
    lines = ["# Gateway overhead on loopback", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in machine().items()]
    lines.append(f"| command | `{' '.join(sys.argv)}` |")
    if ttft:
        lines += ttft_section(args, ttft)
    if relay:
        lines += relay_section(args, relay)
    if release:
        lines += release_section(args, release)
    return "\n".join(lines) + "\n"


def release_section(args: argparse.Namespace, release: dict[str, dict[str, list[float]]]) -> list[str]:
    """Part 3's settings and one table per engine."""
    lines = [
        "",
        "## Time to first token per output release policy",
        "",
        f"- requests: {args.release_requests} per path, sequential, interleaved, after {NUM_WARMUP} "
        f"warm-up; each asks for {args.release_max_tokens} tokens and is cancelled at its first token",
        f"- windows: `OUTPUT_CHECK_TOKENS` {args.check_tokens}, `OUTPUT_FIRST_WINDOW_TOKENS` "
        f"{args.first_window_tokens}; one gateway process per policy, one safety service for all",
        "- screens: the prompt check plus, for strict and growing, the output check of the first "
        "window, each timed as a direct gRPC call to the safety service in the same round",
        "- on the path: strict and growing run prompt screen, engine, output screen one after the "
        "other (their sum); trailing runs the prompt screen alongside prefill (the larger of the two)",
        "- gateway's own: per round, gateway TTFT minus that path (JWT, Redis bucket, token count, "
        "fsynced audit, relaying, and any queueing behind the other processes on the box)",
    ]
    for engine, samples in release.items():
        lines += ["", f"### {engine}", "", *release_rows(args, samples)]
    return lines


def ttft_section(args: argparse.Namespace, ttft: dict[str, list[float]]) -> list[str]:
    """Part 1's settings and table."""
    lines = ["", "## Time to first token of one-token requests", "", "| setting | value |", "| --- | --- |"]
    settings = {
        "TTFT model": f"stories260K (engine on {default_engine_device()}), prompt {PROMPT!r}, max_tokens 1",
        "TTFT requests": (
            f"{args.requests} per path, sequential, interleaved, after {NUM_WARMUP} warm-up each"
        ),
        "gateway path": "JWT RS256, RBAC, intent, token count, Redis Lua bucket, fsynced audit, safety",
        "HTTP client": "raw HTTP/1.1 on a new loopback connection per request, to the first SSE data: line",
    }
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    lines += [
        "",
        "| path | p50 ms | p99 ms | mean ms |",
        "| --- | --- | --- | --- |",
    ]
    for path, values in ttft.items():
        ms = [v * 1000 for v in values]
        lines.append(
            f"| {path} | {percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} | {statistics.fmean(ms):.2f} |"
        )
    overhead = [(g - e) * 1000 for g, e in zip(ttft["through gateway"], ttft["engine direct"], strict=True)]
    p50, p99, mean = percentile(overhead, 50), percentile(overhead, 99), statistics.fmean(overhead)
    lines.append(f"| gateway overhead (paired) | {p50:.2f} | {p99:.2f} | {mean:.2f} |")
    http_over_grpc = [
        (h - g) * 1000 for h, g in zip(ttft["through HTTP front"], ttft["through gateway"], strict=True)
    ]
    p50, p99, mean = (
        percentile(http_over_grpc, 50),
        percentile(http_over_grpc, 99),
        statistics.fmean(http_over_grpc),
    )
    lines.append(f"| HTTP front over gRPC (paired) | {p50:.2f} | {p99:.2f} | {mean:.2f} |")
    return lines


def relay_section(args: argparse.Namespace, relay: list[dict[str, float]]) -> list[str]:
    """Part 2's settings and table."""
    lines = ["", "## Relay throughput of one gateway process", ""]
    lines += [
        f"- source: fixed-rate token source, one token every {args.interval_ms} ms per stream",
        f"- stream: {args.tokens_per_stream} tokens, screened every {args.check_tokens} tokens (strict)",
        f"- duration: {args.duration_s} s per concurrency level, Python asyncio clients in one process",
        "",
    ]
    lines += ["| concurrent streams | streams/s | tokens/s | errors |", "| --- | --- | --- | --- |"]
    for row in relay:
        streams_per_s, tokens_per_s = row["streams_per_s"], row["tokens_per_s"]
        lines.append(
            f"| {row['num_streams']} | {streams_per_s:.1f} | {tokens_per_s:.0f} | {row['errors']:.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--tokens-per-stream", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument(
        "--parts", nargs="+", choices=["ttft", "relay", "release"], default=["ttft", "relay", "release"]
    )
    parser.add_argument("--release-requests", type=int, default=50)
    parser.add_argument("--release-max-tokens", type=int, default=32)
    parser.add_argument("--release-tpot-ms", type=float, default=50.0)
    parser.add_argument("--first-window-tokens", type=int, default=2)
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--fake-engine", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_engine:
        asyncio.run(serve_fake_engine(args.fake_engine, args.interval_ms / 1000))
        return
    ttft: dict[str, list[float]] = {}
    relay: list[dict[str, float]] = []
    release: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as state:
        if "ttft" in args.parts:
            with start_mesh(Path(state) / "ttft", str(resolve_model("stories260k"))) as mesh:
                ttft = asyncio.run(measure_ttft(mesh, args.requests))
        if "relay" in args.parts:
            relay = relay_part(args, Path(state) / "relay")
        if "release" in args.parts:
            release = release_part(args, Path(state) / "release")
    text = report(args, ttft, relay, release)
    print(text)
    if not args.no_write:
        suffix = f"_{args.tag}" if args.tag else ""
        name = f"gateway_overhead_{dt.datetime.now(dt.UTC).date().isoformat()}{suffix}.md"
        path = REPO / "bench" / "results" / name
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
