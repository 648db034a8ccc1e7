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

The engine call counts as a call until the gateway has handled its last message (the
`engine.finished` event on the gateway's span) or its client span ended, whichever came first.
Until 1207180 that span stayed open until the gateway read the stream's end, which came after the
output screen's last check and the release of the held text, so the gateway's own work there hid
under it; since then it ends when the call's status arrives. "gateway's own, to the client span's
end" keeps the span's end alone, the definition every results page before
gateway_spans_2026-12-05_finished-event.md used.

"gateway's own to the first text" is the part issue 13 sets a goal for (at most 1 ms p99 beyond
the screens): from the gateway span's start to the first text sent (`gateway.first_text`), less
what that text waited for, the screens' calls that ended before it and the engine call until the
message that completed the first text reached the gateway (`engine.first_text_arrived`). Its
parts: before the first call, and from the last of those waits to the release. The time before
the span starts (gRPC's receive and the server interceptors) and after the text is yielded (its
write) is in no span; bench/gateway_overhead.py's subtraction sees it.

`--timeline` adds a row per step up to the first text: the span's start, its events and each
child span's start (`<`) and end (`>`), in time order, each step named by its two ends ("start ->
CheckPrompt<" is the admission work before the prompt's screen goes out). Its `requests` column
counts the requests that had that step: steps around Redis commands vary with their timing.

    .venv/bin/python bench/gateway_spans.py --out bench/results/gateway_spans_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.gateway_overhead import percentile, start_mesh
from bench.machine import cpu_name, default_engine_device, git_commit
from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.trace_collector import GATEWAY_GENERATE, GATEWAY_TO_ENGINE, CollectedSpan, TraceCollector
from services.engine.model.registry import resolve_model
from services.gateway.output_screen import ENGINE_FINISHED_EVENT, FIRST_TEXT_ARRIVED_EVENT
from services.gateway.servicer import FIRST_TEXT_EVENT
from services.gateway.tokens import mint_token

POLICIES = ("strict", "growing", "trailing")
ENGINE_CALL = GATEWAY_TO_ENGINE[1]
PROMPT = "Once upon a time"
WARM_UP = 5


class OwnTime(NamedTuple):
    """One request's gateway span split: its total, its own part, and where the own part lies."""

    total_ms: float
    own_ms: float
    before_first_call_ms: float  # root start to the first RPC's start
    between_calls_ms: float  # gaps between RPCs
    after_last_call_ms: float  # the last RPC's end to the root's end
    redis_before_first_call_ms: float  # Redis commands inside the first part
    by_call: dict[str, float]


def _clipped(intervals: list[tuple[int, int]], start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    return [(max(start, start_ns), min(end, end_ns)) for start, end in intervals if end > start_ns]


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _root_and_children(spans: list[CollectedSpan]) -> tuple[CollectedSpan, list[CollectedSpan]]:
    """The gateway's Generate span and the gateway's spans directly under it."""
    (root,) = [s for s in spans if (s.service, s.name) == GATEWAY_GENERATE]
    return root, [s for s in spans if s.service == root.service and s.parent_span_id == root.span_id]


def own_ms(spans: list[CollectedSpan], to_client_end: bool = False) -> OwnTime:
    """One request's trace: the root span, the gateway's own time and where it lies, ms per RPC.
    The engine call ends when its last message reached the gateway, unless `to_client_end`."""
    root, children = _root_and_children(spans)
    calls = [s for s in children if "Service/" in s.name]
    finished_ns = root.events.get(ENGINE_FINISHED_EVENT)
    if finished_ns is None or to_client_end:
        finished_ns = root.end_ns
    intervals = [
        (s.start_ns, min(s.end_ns, finished_ns) if s.name == ENGINE_CALL else s.end_ns) for s in calls
    ]
    covered = _union(_clipped(intervals, root.start_ns, root.end_ns))
    first_ns = covered[0][0] if covered else root.end_ns
    last_ns = covered[-1][1] if covered else root.end_ns
    gaps_ns = sum(b[0] - a[1] for a, b in itertools.pairwise(covered))
    redis = _clipped(
        [(s.start_ns, s.end_ns) for s in children if "Service/" not in s.name], root.start_ns, first_ns
    )
    by_call: dict[str, float] = defaultdict(float)
    for s in calls:
        by_call[s.name.rsplit("/", 1)[-1]] += s.duration_ms
    return OwnTime(
        total_ms=root.duration_ms,
        own_ms=(root.end_ns - root.start_ns - sum(end - start for start, end in covered)) / 1e6,
        before_first_call_ms=(first_ns - root.start_ns) / 1e6,
        between_calls_ms=gaps_ns / 1e6,
        after_last_call_ms=(root.end_ns - last_ns) / 1e6,
        redis_before_first_call_ms=sum(end - start for start, end in _union(redis)) / 1e6,
        by_call=dict(by_call),
    )


class OwnToFirstText(NamedTuple):
    """The gateway's own time to the first text, and its two ends."""

    own_ms: float
    before_first_call_ms: float  # root start to the first RPC's start
    after_last_wait_ms: float  # the last thing the first text waited for, to its release


def own_to_first_text_ms(spans: list[CollectedSpan]) -> OwnToFirstText:
    """The gateway's own part of the time to first text: from its span's start to the first text
    sent (FIRST_TEXT_EVENT), less what that text waited for: the screens' calls that ended before
    it, and the engine call until the message that completed the first text reached the gateway
    (FIRST_TEXT_ARRIVED_EVENT), not until its client span ended, which may come later."""
    root, children = _root_and_children(spans)
    first_text_ns = root.events[FIRST_TEXT_EVENT]
    arrived_ns = root.events[FIRST_TEXT_ARRIVED_EVENT]
    calls = [s for s in children if "Service/" in s.name]
    intervals = [(s.start_ns, arrived_ns if s.name == ENGINE_CALL else s.end_ns) for s in calls]
    covered = _union(_clipped([i for i in intervals if i[1] <= first_text_ns], root.start_ns, first_text_ns))
    waited_ns = sum(end - start for start, end in covered)
    first_ns = covered[0][0] if covered else first_text_ns
    last_ns = covered[-1][1] if covered else root.start_ns
    return OwnToFirstText(
        own_ms=(first_text_ns - root.start_ns - waited_ns) / 1e6,
        before_first_call_ms=(first_ns - root.start_ns) / 1e6,
        after_last_wait_ms=(first_text_ns - last_ns) / 1e6,
    )


def timeline(spans: list[CollectedSpan]) -> list[tuple[str, float]]:
    """The steps of one request up to its first text, in time order, each with the ms since the
    one before: the gateway span's start, its events, and each child span's start and end (`<`
    and `>` after the call's or Redis command's name). A step's label names both its ends, so the
    same label across requests is the same stretch of work or wait."""
    root, children = _root_and_children(spans)
    first_text_ns = root.events[FIRST_TEXT_EVENT]
    points = [("start", root.start_ns), *root.events.items()]
    for span in children:
        name = span.name.rsplit("/", 1)[-1]
        points += [(f"{name}<", span.start_ns), (f"{name}>", span.end_ns)]
    ordered = sorted((p for p in points if p[1] <= first_text_ns), key=lambda p: p[1])
    return [(f"{a[0]} -> {b[0]}", (b[1] - a[1]) / 1e6) for a, b in itertools.pairwise(ordered)]


def measure(policy: str, args: argparse.Namespace, collector: TraceCollector) -> dict[str, list[float]]:
    """Per request: the gateway span, the gateway's own time and each call's time, in ms."""
    samples: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="gateway-spans-") as tmp:
        model = str(resolve_model("stories260k"))
        release = {"THERMOCLINE_GATEWAY_OUTPUT_RELEASE": policy}
        if args.rate_lease_hold_s is not None:
            release["THERMOCLINE_GATEWAY_RATE_LEASE_HOLD_S"] = str(args.rate_lease_hold_s)
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
                split = own_ms(spans)
                samples["gateway span"].append(split.total_ms)
                samples["gateway's own"].append(split.own_ms)
                samples["gateway's own, to the client span's end"].append(
                    own_ms(spans, to_client_end=True).own_ms
                )
                to_text = own_to_first_text_ms(spans)
                samples["gateway's own to the first text"].append(to_text.own_ms)
                samples["to the first text: before the first call"].append(to_text.before_first_call_ms)
                samples["to the first text: last wait to the release"].append(to_text.after_last_wait_ms)
                samples["own: before the first call"].append(split.before_first_call_ms)
                samples["own: Redis before the first call"].append(split.redis_before_first_call_ms)
                samples["own: between calls"].append(split.between_calls_ms)
                samples["own: after the last call"].append(split.after_last_call_ms)
                for name, ms in split.by_call.items():
                    samples[name].append(ms)
                if args.timeline:
                    for step, ms in timeline(spans):
                        samples[f"step: {step}"].append(ms)
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
    parser.add_argument(
        "--rate-lease-hold-s", type=float, default=None, help="the gateway's request lease (0: off)"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also each step up to the first text (events and calls' ends, in time order)",
    )
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
            f"- settings: stories260K, engine on {default_engine_device()}, prompt {PROMPT!r}, "
            f"max_tokens {args.max_tokens}, "
            f"{args.requests} sequential requests per policy after {WARM_UP} warm-up, one mesh per "
            "policy, default output screening windows, request lease hold "
            f"{'default' if args.rate_lease_hold_s is None else args.rate_lease_hold_s} s",
            "- reproduce: `.venv/bin/python bench/gateway_spans.py --requests "
            f"{args.requests} --max-tokens {args.max_tokens} --policies {' '.join(args.policies)}"
            + ("" if args.rate_lease_hold_s is None else f" --rate-lease-hold-s {args.rate_lease_hold_s:g}")
            + (" --timeline" if args.timeline else "")
            + "`",
            "- gateway's own: the gateway's Generate span minus the union of its RPC client spans, "
            "the engine call ending when its last message reached the gateway (`engine.finished`)",
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
