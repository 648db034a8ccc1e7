"""Garbage-collector pauses in each service of a mesh under a run of requests, and the client's
time to first token beside them.

Every service times its collections into `thermocline_gc_pause_seconds` by generation
(services/common/gc_pauses.py). This bench starts the stories260K mesh, sends `--requests`
sequential streamed requests through the gateway, reads each service's histogram before and after,
and prints per service and generation the collections, their total and mean pause, and the bucket
of the longest. A full collection (generation 2) walks every tracked object the process holds, so
whether a service froze its start-up heap (`thermocline_gc_frozen_objects`) decides its size. The
client's time to first token (p50, p99, max) shows whether a long pause reached a caller.

Full collections are rare: the gateway ran one in about 1,000 requests, so runs shorter than that
may show none either way.

    .venv/bin/python bench/gc_pauses.py --requests 2000 --out bench/results/gc_pauses_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.gateway_overhead import percentile, start_mesh
from bench.machine import cpu_name, default_engine_device, git_commit
from services.cli.client import build_request, call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.engine.model.registry import resolve_model
from services.gateway.tokens import mint_token

SERVICES = ("gateway", "safety", "engine", "kvstore")
PAUSE = "thermocline_gc_pause_seconds"
FROZEN = "thermocline_gc_frozen_objects"
PROMPT = "Once upon a time"
WARM_UP = 5

# (service, generation) -> {"count": n, "sum": s, le: cumulative count}; FROZEN under generation ""
Histograms = dict[tuple[str, str], dict[str, float]]


def scrape(mesh: Mesh) -> Histograms:
    """Each service's GC pause histogram and frozen-object count."""
    found: Histograms = {}
    for service in SERVICES:
        url = f"http://127.0.0.1:{mesh.config.ports.metrics[service]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == FROZEN:
                    found[(service, "")] = {"frozen": sample.value}
                elif sample.name.startswith(PAUSE + "_"):
                    row = found.setdefault((service, sample.labels["generation"]), {})
                    key = sample.labels.get("le", sample.name.rsplit("_", 1)[-1])
                    row[key] = sample.value
    return found


def longest_bucket_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """The upper bound (ms) of the smallest bucket that holds every pause of the run."""
    buckets = [le for le in after if le not in ("count", "sum")]
    bounds = sorted((float(le), after[le] - before.get(le, 0.0)) for le in buckets)
    run_count = after["count"] - before.get("count", 0.0)
    for bound, cumulative in bounds:
        if cumulative >= run_count:
            return bound * 1e3
    return math.inf


def run(args: argparse.Namespace) -> tuple[Histograms, Histograms, list[float]]:
    """The histograms before and after the measured requests, and each request's TTFT (ms)."""
    ttft_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gc-pauses-") as tmp:
        env = {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": args.policy}
        with (
            start_mesh(Path(tmp), str(resolve_model("stories260k")), **env) as mesh,
            grpc.insecure_channel(mesh.target("gateway")) as channel,
        ):
            token = mint_token(mesh.private_key_path.read_bytes(), subject="bench", tenant="acme")
            metadata = call_metadata(token)
            request = build_request(PROMPT, max_tokens=args.max_tokens)
            before: Histograms = {}
            for index in range(WARM_UP + args.requests):
                if index == WARM_UP:
                    before = scrape(mesh)
                started = time.perf_counter()
                first: float | None = None
                for _ in stream_generate(channel, request, metadata, timeout_s=60):
                    if first is None:
                        first = time.perf_counter() - started
                if index >= WARM_UP and first is not None:
                    ttft_ms.append(first * 1e3)
            return before, scrape(mesh), ttft_ms


def table(before: Histograms, after: Histograms) -> str:
    lines = [
        "| service | frozen objects | generation | collections | total ms | mean ms | longest within |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for service in SERVICES:
        frozen = after.get((service, ""), {}).get("frozen", 0.0)
        for generation in ("0", "1", "2"):
            key = (service, generation)
            if key not in after:
                continue
            count = after[key]["count"] - before.get(key, {}).get("count", 0.0)
            seconds = after[key]["sum"] - before.get(key, {}).get("sum", 0.0)
            mean = f"{seconds / count * 1e3:.2f}" if count else "-"
            longest = f"{longest_bucket_ms(before.get(key, {}), after[key]):g} ms" if count else "-"
            total_ms = f"{seconds * 1e3:.1f}"
            cells = [service, f"{frozen:,.0f}", generation, f"{count:.0f}", total_ms, mean, longest]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--policy", choices=("strict", "growing", "trailing"), default="strict")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args()
    before, after, ttft_ms = run(args)
    text = "\n".join(
        [
            "# Garbage-collector pauses per service over a run of requests",
            "",
            f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {git_commit()}",
            f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs shared by every service and the "
            f"client; Python {platform.python_version()}",
            f"- settings: stories260K, engine on {default_engine_device()}, prompt {PROMPT!r}, max_tokens "
            f"{args.max_tokens}, output release {args.policy}, {args.requests} sequential requests after "
            f"{WARM_UP} warm-up",
            f"- reproduce: `.venv/bin/python bench/gc_pauses.py --requests {args.requests} --max-tokens "
            f"{args.max_tokens} --policy {args.policy}`",
            "- collections counted from the first measured request to the last; `longest within`: the "
            "upper bound of the smallest histogram bucket that holds every pause of the run",
            "",
            table(before, after),
            "",
            f"Client's time to first token through the gateway: p50 {percentile(ttft_ms, 50):.2f} ms, "
            f"p99 {percentile(ttft_ms, 99):.2f} ms, max {max(ttft_ms):.2f} ms ({len(ttft_ms)} requests).",
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
