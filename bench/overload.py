"""Overload on the CPU: open-loop arrivals at twice the SLA knee, against a gateway that sheds load.

    .venv/bin/python bench/overload.py                      # 10 min, writes bench/results/overload_<date>.md
    .venv/bin/python bench/overload.py --duration-s 60 --no-write

The knee is what `thermocline loadgen --sweep` found (bench/sla_cpu.py writes it to
bench/results/sla_cpu_<date>.json; `--knee-from` picks the file, `--knee` overrides it): the lowest
knee over the workload's classes, since the mix is sent as a whole. The run starts the whole mesh
(SmolLM2-135M-Instruct, tenant rate limits lifted) with the gateway's stream cap
(THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS) derived from the concurrency the mesh carried at the
knee (Little's law: knee rate x mean E2E there) less `--cap-headroom`, rounded down, sends Poisson
arrivals of bench/loadgen_cpu_workload.toml at `--factor` x the knee, and checks:

- the admitted requests (status OK) keep each class's p99 inside its SLA;
- every other request ends RESOURCE_EXHAUSTED with a `grpc-retry-pushback-ms` retry hint;
- no mesh process exits;
- each process's resident memory at the end is within `--max-rss-growth` of its level after warm-up.

Why the headroom: the knee is the highest load whose p99 is still inside the SLA, so its p99 sits at
the SLA's edge, and the concurrency Little's law gives there is the *mean* over a run whose
concurrency rose and fell. Past the knee the cap is reached all the time, so a cap equal to that
mean holds the mesh at the knee's load for the whole run, and its p99 lands on the edge too (the
run of 2026-12-01: 12.4 s against 12 s). A cap below it keeps the admitted requests inside.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from bench.sla_cpu import git_commit, run_sweep, table  # noqa: E402
from services.cli.client import build_request, call_metadata  # noqa: E402
from services.cli.loadgen.command import UNLIMITED_TENANTS  # noqa: E402
from services.cli.loadgen.record import OK, RequestRecord  # noqa: E402
from services.cli.loadgen.schedule import open_loop_plan  # noqa: E402
from services.cli.loadgen.sla import Sla  # noqa: E402
from services.cli.loadgen.stats import ClassSummary, LatencySummary, summarize_class  # noqa: E402
from services.cli.loadgen.workload import (  # noqa: E402
    PlannedRequest,
    Workload,
    build_workload,
    load_workload_file,
)
from services.cli.mesh import Mesh, MeshConfig, Ports  # noqa: E402
from services.gateway.rate_limiter import PUSHBACK_KEY  # noqa: E402
from services.gateway.tokens import mint_token  # noqa: E402
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc  # noqa: E402

WORKLOAD = REPO / "bench" / "loadgen_cpu_workload.toml"
KNEE_FILE = REPO / "bench" / "results" / "sla_cpu_2026-11-30.json"
MODEL = "smollm2-135m-instruct"
SHED = "RESOURCE_EXHAUSTED"
MIB = 1024 * 1024
NUM_ALONE = 6  # requests sent one at a time before the overload: what one request costs right now


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--knee-from", type=Path, default=KNEE_FILE, help="a loadgen sweep's JSON report")
    parser.add_argument("--knee", type=float, help="the knee in req/s (overrides --knee-from)")
    parser.add_argument(
        "--sweep", metavar="LEVELS", help="find the knee now: a loadgen sweep over these rates (req/s) first"
    )
    parser.add_argument("--sweep-duration-s", type=float, default=45.0, help="seconds of arrivals per level")
    parser.add_argument("--factor", type=float, default=2.0, help="offered load as a multiple of the knee")
    parser.add_argument("--max-streams", type=int, help="the gateway's stream cap (default: from the knee)")
    parser.add_argument(
        "--cap-headroom",
        type=float,
        default=0.25,
        help="the cap is the knee's concurrency times (1 - this), rounded down, and at least 1",
    )
    parser.add_argument("--duration-s", type=float, default=600.0, help="seconds of arrivals")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="each request's deadline")
    parser.add_argument("--sample-s", type=float, default=10.0, help="how often memory is sampled")
    parser.add_argument(
        "--warmup-s", type=float, default=60.0, help="memory baseline: the first sample after"
    )
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed end/baseline - 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the report instead of writing it")
    return parser.parse_args()


@dataclass(frozen=True)
class Knee:
    """Where the sweep put the knee, and the concurrency the mesh carried there."""

    rate_per_s: float
    num_streams: int
    source: str
    sweep_markdown: str = ""
    concurrency: float | None = None  # Little's law at the knee: rate x mean E2E


def read_knee(args: argparse.Namespace, sweep_dir: Path) -> Knee:
    """The lowest class knee of a sweep (run now with --sweep, else --knee-from), and the mean
    concurrency at that level. When the fresh sweep finds no level inside the SLA, the lowest level
    it swept stands in for the knee (a knee measured on another day would say nothing about the mesh
    as it runs now), and the report says so."""
    if args.knee is not None:
        return Knee(args.knee, args.max_streams or 4, "--knee")
    sweep_markdown = ""
    if args.sweep:
        sweep = argparse.Namespace(levels=args.sweep, duration_s=args.sweep_duration_s, seed=args.seed)
        document = run_sweep(sweep, sweep_dir)
        sweep_markdown = (sweep_dir / "sweep.md").read_text()
        source = f"a sweep run just before ({args.sweep} req/s, {args.sweep_duration_s:g} s per level)"
    else:
        document = json.loads(args.knee_from.read_text())
        source = str(args.knee_from.relative_to(REPO))
    knees = [k for k in document["knees"].values() if k is not None]
    highest = max(level["load"] for level in document["levels"])
    if knees and min(knees) == highest:  # every class passed every level: the knee lies above
        raise SystemExit(
            f"the sweep found no level past the knee (every class met its SLA up to {highest:g} req/s): "
            "the knee is above it, so twice it would be a guess; sweep higher levels"
        )
    missing = sorted(name for name, knee in document["knees"].items() if knee is None)
    if knees:
        rate = min(knees)
        if missing:  # such a class failed even the lowest level: its knee lies below the sweep
            lowest = min(level["load"] for level in document["levels"])
            below = f"its knee is below {lowest:g} req/s"
            source += f"; {', '.join(missing)} met its SLA at no level swept ({below})"
    else:
        rate = min(level["load"] for level in document["levels"])
        source += f", which found no level inside the SLA: its lowest level, {rate:g} req/s, stands in"
    level = next(level for level in document["levels"] if level["load"] == rate)
    mean_e2e_s = level["overall"]["e2e_ms"]["mean_ms"] / 1000
    concurrency = rate * mean_e2e_s
    streams = args.max_streams or max(1, math.floor(concurrency * (1 - args.cap_headroom)))
    return Knee(rate, streams, source, sweep_markdown, concurrency)


async def send(
    stub: pb_grpc.GatewayServiceStub, token: str, planned: PlannedRequest, start_s: float, timeout_s: float
) -> tuple[RequestRecord, str | None]:
    """One request streamed to its end: its record, and the retry hint of a refusal."""
    request = build_request(planned.prompt, max_tokens=planned.max_tokens)
    started_s = time.monotonic()
    first_s = None
    num_output = 0
    call = stub.Generate(request, metadata=call_metadata(token, planned.intent), timeout=timeout_s)
    try:
        async for response in call:
            if first_s is None and response.HasField("delta") and response.delta.token_ids:
                first_s = time.monotonic()
            if response.HasField("done"):
                num_output = response.done.usage.completion_tokens
    except grpc.aio.AioRpcError as error:
        hint = dict(error.trailing_metadata() or ()).get(PUSHBACK_KEY)
        record = RequestRecord(
            planned.intent, error.code().name, started_s - start_s, 0.0, error=error.details()
        )
        return record, hint
    ended_s = time.monotonic()
    ttft_s = None if first_s is None else first_s - started_s
    record = RequestRecord(
        planned.intent,
        OK,
        started_s - start_s,
        ended_s - started_s,
        ttft_s=ttft_s,
        num_output_tokens=num_output,
    )
    return record, None


async def one_at_a_time(mesh: Mesh, token: str, workload: Workload, args: argparse.Namespace) -> str:
    """E2E of a few requests sent alone: what the machine gives one request right now, for the SLA."""
    rng = random.Random(args.seed + 2)
    async with grpc.aio.insecure_channel(mesh.target("gateway")) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        start_s = time.monotonic()
        records = [
            (await send(stub, token, workload.draw(rng), start_s, args.timeout_s))[0]
            for _ in range(NUM_ALONE)
        ]
    times = ", ".join(
        f"{r.intent} {r.e2e_s * 1000:.0f} ms" if r.is_ok else f"{r.intent} {r.status}" for r in records
    )
    return f"E2E {times}"


def rss_bytes(pid: int) -> int:
    """A process's resident set size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def sample_memory(mesh: Mesh, every_s: float, samples: list[tuple[float, dict[str, int]]]) -> None:
    """Appends (seconds since start, RSS per process) every `every_s` until cancelled."""
    start_s = time.monotonic()
    while True:
        alive = {name: p.pid for name, p in mesh.processes.items() if p.poll() is None}
        samples.append((time.monotonic() - start_s, {name: rss_bytes(pid) for name, pid in alive.items()}))
        await asyncio.sleep(every_s)  # a sampling period, not synchronisation


async def drive(
    mesh: Mesh, token: str, plan: list[PlannedRequest], args: argparse.Namespace
) -> tuple[list[tuple[RequestRecord, str | None]], list[tuple[float, dict[str, int]]], float]:
    """Sends the plan on schedule while sampling memory; returns the results, samples and wall time."""
    samples: list[tuple[float, dict[str, int]]] = []
    sampler = asyncio.create_task(sample_memory(mesh, args.sample_s, samples))
    async with grpc.aio.insecure_channel(mesh.target("gateway")) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        start_s = time.monotonic()

        async def at_offset(planned: PlannedRequest) -> tuple[RequestRecord, str | None]:
            await asyncio.sleep(max(0.0, (planned.offset_s or 0.0) - (time.monotonic() - start_s)))
            return await send(stub, token, planned, start_s, args.timeout_s)

        results = await asyncio.gather(*(at_offset(p) for p in plan))
        wall_s = time.monotonic() - start_s
    sampler.cancel()
    return list(results), samples, wall_s


@dataclass(frozen=True)
class Findings:
    """The run's verdicts, each with the figures behind it."""

    class_rows: list[str]
    shed_row: str
    crash_row: str
    memory_rows: list[str]
    passed: bool


def class_findings(workload: Workload, records: list[RequestRecord], wall_s: float) -> tuple[list[str], bool]:
    """One row per class: sent, admitted, shed, other failures, admitted p99 against the SLA."""
    rows, passed = [], True
    for intent, sla in sorted(workload.slas.items()):
        mine = [r for r in records if r.intent == intent]
        summary = summarize_class(mine, wall_s)
        verdict = sla_verdict(sla, summary)
        passed &= verdict == "pass"
        rows.append(class_row(intent, sla, summary, verdict))
    return rows, passed


def sla_verdict(sla: Sla, summary: ClassSummary) -> str:
    """pass, or what broke: a p99 over its limit, or a failure other than shedding."""
    problems = [f"{n} {s}" for s, n in summary.failed_by_status.items() if s != SHED]
    for metric, limit_ms in sla.limits.items():
        latency = summary.latency(metric)
        if latency is not None and latency.p99_ms > limit_ms:
            problems.append(f"{metric} p99 {latency.p99_ms:.0f} ms > {limit_ms:g} ms")
    if summary.num_succeeded == 0:
        problems.append("nothing admitted")
    return "pass" if not problems else "fail (" + "; ".join(problems) + ")"


def class_row(intent: str, sla: Sla, summary: ClassSummary, verdict: str) -> str:
    """A markdown row of the class table."""
    shed = summary.failed_by_status.get(SHED, 0)
    other = summary.num_failed - shed

    def p99(latency: LatencySummary | None) -> str:
        return "–" if latency is None else f"{latency.p50_ms:.0f} / {latency.p99_ms:.0f}"

    limits = ", ".join(f"{metric} ≤ {limit:g} ms" for metric, limit in sla.limits.items())
    return (
        f"| {intent} | {summary.num_sent} | {summary.num_succeeded} | {shed} | {other} | "
        f"{p99(summary.ttft)} | {p99(summary.e2e)} | {limits} | {verdict} |"
    )


def shed_finding(results: list[tuple[RequestRecord, str | None]]) -> tuple[str, bool]:
    """How many refusals were RESOURCE_EXHAUSTED with a retry hint."""
    shed = [(r, hint) for r, hint in results if r.status == SHED]
    hinted = Counter(hint for _, hint in shed if hint is not None)
    num_unhinted = sum(1 for _, hint in shed if hint is None)
    messages = Counter(r.error for r, _ in shed)
    example = messages.most_common(1)[0][0] if messages else "–"
    hints = ", ".join(f"{h} ms x {n}" for h, n in hinted.most_common()) or "none"
    row = f"{len(shed)} shed; retry hints: {hints}; without a hint: {num_unhinted}; message: {example!r}"
    return row, num_unhinted == 0


def crash_finding(mesh: Mesh) -> tuple[str, bool]:
    """Which mesh processes are still running."""
    gone = {name: p.returncode for name, p in mesh.processes.items() if p.poll() is not None}
    if gone:
        return f"exited: {gone}", False
    return f"all {len(mesh.processes)} processes running at the end ({', '.join(mesh.processes)})", True


def memory_findings(
    samples: list[tuple[float, dict[str, int]]], warmup_s: float, max_growth: float
) -> tuple[list[str], bool]:
    """Per process: RSS after warm-up, peak, at the end, and the end's growth over the baseline."""
    after = [s for s in samples if s[0] >= warmup_s] or samples
    baseline, last = after[0][1], after[-1][1]
    rows, passed = [], True
    for name in sorted(baseline):
        peak = max(s[1].get(name, 0) for s in after)
        growth = last.get(name, 0) / baseline[name] - 1 if baseline[name] else 0.0
        ok = growth <= max_growth
        passed &= ok
        rows.append(
            f"| {name} | {baseline[name] / MIB:.0f} | {peak / MIB:.0f} | {last.get(name, 0) / MIB:.0f} | "
            f"{growth * 100:+.1f}% | {'flat' if ok else 'grew'} |"
        )
    return rows, passed


Results = list[tuple[RequestRecord, str | None]]
Samples = list[tuple[float, dict[str, int]]]


def findings(
    mesh: Mesh,
    workload: Workload,
    results: Results,
    samples: Samples,
    wall_s: float,
    args: argparse.Namespace,
) -> Findings:
    """Every verdict of the run."""
    records = [r for r, _ in results]
    class_rows, classes_ok = class_findings(workload, records, wall_s)
    shed_row, shed_ok = shed_finding(results)
    crash_row, crash_ok = crash_finding(mesh)
    memory_rows, memory_ok = memory_findings(samples, args.warmup_s, args.max_rss_growth)
    passed = classes_ok and shed_ok and crash_ok and memory_ok
    return Findings(class_rows, shed_row, crash_row, memory_rows, passed)


def run(args: argparse.Namespace, knee: Knee, workload: Workload, state_dir: Path) -> tuple[Findings, dict]:
    """Starts the mesh, sends the overload, and judges it."""
    rate = knee.rate_per_s * args.factor
    rng = random.Random(args.seed)
    plan = open_loop_plan(workload, rate, rng, random.Random(args.seed + 1), duration_s=args.duration_s)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "tenants.json").write_text(json.dumps(UNLIMITED_TENANTS))
    env = {
        "THERMOCLINE_GATEWAY_TENANTS_FILE": str(state_dir / "tenants.json"),
        "THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS": str(knee.num_streams),
    }
    config = MeshConfig(model=MODEL, state_dir=state_dir, ports=Ports.free(), env=env)
    with Mesh(config) as mesh:
        token = mint_token(mesh.private_key_path.read_bytes(), subject="overload", tenant="overload")
        load_before = os.getloadavg()
        alone = asyncio.run(one_at_a_time(mesh, token, workload, args))
        results, samples, wall_s = asyncio.run(drive(mesh, token, plan, args))
        facts = findings(mesh, workload, results, samples, wall_s, args)
    context = {"rate": rate, "num_planned": len(plan), "wall_s": wall_s, "env": env, "alone": alone}
    context["load"] = (load_before, os.getloadavg())
    return facts, context


def cap_source(knee: Knee, args: argparse.Namespace) -> str:
    """How the stream cap was chosen."""
    if args.max_streams is not None or knee.concurrency is None:
        return "set by --max-streams"
    return (
        f"the knee's concurrency {knee.concurrency:.2f} (knee rate x mean E2E there) x "
        f"(1 - {args.cap_headroom:g} headroom), rounded down"
    )


def report(args: argparse.Namespace, knee: Knee, facts: Findings, context: dict, stamp: str) -> str:
    """The markdown report: settings, then each verdict with its figures."""
    (before, after) = context["load"]
    header = [
        ("date (UTC)", stamp),
        ("git commit", git_commit()),
        ("cpu", f"{cpu_name()}, {os.cpu_count()} logical cpus"),
        ("load average (1 min)", f"{before[0]:.1f} before, {after[0]:.1f} after"),
        ("model", f"{MODEL} on the CPU, engine defaults"),
        ("workload", "bench/loadgen_cpu_workload.toml (its classes, shares and SLAs)"),
        ("knee", f"{knee.rate_per_s:g} req/s, the lowest class knee of {knee.source}"),
        ("offered load", f"{context['rate']:g} req/s ({args.factor:g} x the knee), open loop, Poisson"),
        ("arrivals", f"{args.duration_s:g} s ({context['num_planned']} requests), then in-flight ones end"),
        ("wall time", f"{context['wall_s']:.0f} s"),
        (
            "gateway stream cap",
            f"{knee.num_streams} (THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS); {cap_source(knee, args)}",
        ),
        ("request deadline", f"{args.timeout_s:g} s"),
        ("memory baseline", f"the first sample {args.warmup_s:g} s in; sampled every {args.sample_s:g} s"),
        ("seed", str(args.seed)),
        ("one request at a time, just before", context["alone"]),
    ]
    classes = "\n".join(
        [
            "| class | sent | admitted (OK) | shed | other failures | admitted TTFT ms p50 / p99 | "
            "admitted E2E ms p50 / p99 | SLA (p99) | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *facts.class_rows,
        ]
    )
    memory = "\n".join(
        [
            "| process | RSS MiB after warm-up | peak | end | end vs baseline | verdict |",
            "| --- | --- | --- | --- | --- | --- |",
            *facts.memory_rows,
        ]
    )
    sweep = f"--sweep {args.sweep} --sweep-duration-s {args.sweep_duration_s:g} " if args.sweep else ""
    sweep += f"--knee {args.knee:g} " if args.knee is not None else ""
    sweep += f"--max-streams {args.max_streams} " if args.max_streams is not None else ""
    sweep += f"--cap-headroom {args.cap_headroom:g} " if args.max_streams is None else ""
    reproduce = (
        f".venv/bin/python bench/overload.py {sweep}--duration-s {args.duration_s:g} "
        f"--factor {args.factor:g} --seed {args.seed}"
    )
    return (
        f"# Overload on the CPU: {args.factor:g} x the SLA knee for {args.duration_s / 60:g} min\n\n"
        f"{table(header)}\n\n## Classes\n\n{classes}\n\n## Shedding\n\n{facts.shed_row}\n\n"
        f"## Processes\n\n{facts.crash_row}\n\n"
        f"## Memory (max growth {args.max_rss_growth:.0%})\n\n{memory}\n\n"
        f"## Verdict\n\n{'pass' if facts.passed else 'fail'}: see the rows above.\n\n"
        f"Reproduce: `{reproduce}`\n"
        + (f"\n## The sweep run before the overload\n\n{knee.sweep_markdown}" if knee.sweep_markdown else "")
    )


def main() -> int:
    args = parse_args()
    workload = build_workload(load_workload_file(WORKLOAD), None)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as tmp:
        knee = read_knee(args, Path(tmp))
        print(f"knee {knee.rate_per_s:g} req/s ({knee.source}); gateway stream cap {knee.num_streams}")
        facts, context = run(args, knee, workload, Path(tmp) / "overload")
    text = report(args, knee, facts, context, stamp)
    if args.no_write:
        print(text)
    else:
        path = REPO / "bench" / "results" / f"overload_{stamp.split()[0]}.md"
        path.write_text(text)
        print(f"wrote {path}")
    return 0 if facts.passed else 1


if __name__ == "__main__":
    sys.exit(main())
