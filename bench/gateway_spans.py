"""The gateway's own time per request, read from its own trace spans.

bench/gateway_overhead.py splits TTFT by subtraction: gateway TTFT minus the engine and the
screens, each timed by a direct call in the same round. On a small box that charges the gateway
with whatever the other processes were doing at that moment (their CPUs are shared). This
benchmark reads each request's own trace instead: the mesh exports its spans to an in-process
OTLP receiver, and for each request the gateway's own time is its Generate server span minus the
union of its RPC client spans (safety CheckPrompt and CheckOutput, engine Generate). What is left
is the gateway's work and waits that are not a call to another service: JWT and RBAC, the Redis
buckets (Redis commands count as the gateway's), the fsynced audit event, relaying, and the event
loop's scheduling. Requests ask for `--max-tokens` tokens and are read to the end, one at a time.

    .venv/bin/python bench/gateway_spans.py --out bench/results/gateway_spans_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.gateway_overhead import percentile, start_mesh
from bench.machine import cpu_name, git_commit
from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.trace_collector import GATEWAY_GENERATE, CollectedSpan, TraceCollector
from services.engine.model.registry import resolve_model
from services.gateway.tokens import mint_token

POLICIES = ("strict", "growing", "trailing")
PROMPT = "Once upon a time"
WARM_UP = 5


def own_ms(spans: list[CollectedSpan]) -> tuple[float, float, dict[str, float]]:
    """(root span ms, the gateway's own ms, ms per child RPC) of one request's trace."""
    (root,) = [s for s in spans if (s.service, s.name) == GATEWAY_GENERATE]
    calls = [
        s
        for s in spans
        if s.service == root.service and s.parent_span_id == root.span_id and "Service/" in s.name
    ]
    covered, current = 0, None
    for start, end in sorted((max(s.start_ns, root.start_ns), min(s.end_ns, root.end_ns)) for s in calls):
        if current is None or start > current[1]:
            covered += 0 if current is None else current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    covered += 0 if current is None else current[1] - current[0]
    by_call: dict[str, float] = defaultdict(float)
    for s in calls:
        by_call[s.name.rsplit("/", 1)[-1]] += s.duration_ms
    return root.duration_ms, (root.end_ns - root.start_ns - covered) / 1e6, dict(by_call)


def measure(policy: str, args: argparse.Namespace, collector: TraceCollector) -> dict[str, list[float]]:
    """Per request: the gateway span, the gateway's own time and each call's time, in ms."""
    samples: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="gateway-spans-") as tmp:
        model = str(resolve_model("stories260k"))
        release = {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": policy}
        with (
            start_mesh(Path(tmp), model, otlp_endpoint=collector.endpoint, **release) as mesh,
            grpc.insecure_channel(mesh.target("gateway")) as channel,
        ):
            token = mint_token(mesh.private_key_path.read_bytes(), subject="bench", tenant="acme")
            metadata = call_metadata(token)
            request = build_request(PROMPT, max_tokens=args.max_tokens)
            for index in range(WARM_UP + args.requests):
                result = collect(stream_generate(channel, request, metadata, timeout_s=60))
                assert result.done is not None, "a request did not complete"
                if index < WARM_UP:
                    continue
                spans = collector.wait_for_spans(result.done.trace_id, {GATEWAY_GENERATE}, timeout_s=60)
                total, own, by_call = own_ms(spans)
                samples["gateway span"].append(total)
                samples["gateway's own"].append(own)
                for name, ms in by_call.items():
                    samples[name].append(ms)
    return samples


def table(results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        "| policy | span | requests | p50 ms | p90 ms | p99 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for policy, samples in results.items():
        for name, values in samples.items():
            p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
            lines.append(f"| {policy} | {name} | {len(values)} | {p50:.2f} | {p90:.2f} | {p99:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args()
    collector = TraceCollector().start()
    try:
        results = {policy: measure(policy, args, collector) for policy in args.policies}
    finally:
        collector.stop()
    commit = git_commit()
    text = "\n".join(
        [
            "# The gateway's own time per request, from its spans",
            "",
            f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {commit}",
            f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs (gateway, safety, engine and "
            f"redis-server share them), load average {os.getloadavg()[0]:.1f} at the end; "
            f"Python {platform.python_version()}",
            f"- settings: stories260K on the CPU, prompt {PROMPT!r}, max_tokens {args.max_tokens}, "
            f"{args.requests} sequential requests per policy after {WARM_UP} warm-up, one mesh per "
            "policy, default output screening windows",
            "- reproduce: `.venv/bin/python bench/gateway_spans.py --requests "
            f"{args.requests} --max-tokens {args.max_tokens} --policies {' '.join(args.policies)}`",
            "- gateway's own: the gateway's Generate span minus the union of its RPC client spans",
            "",
            table(results),
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
