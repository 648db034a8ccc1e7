"""Another caller's latency while a flood of oversized prompts hits the gateway (issue 11, severe 3).

    .venv/bin/python bench/gateway_flood.py                  # writes bench/results/gateway_flood_<date>.md
    .venv/bin/python bench/gateway_flood.py --calls 100 --no-write
    .venv/bin/python bench/gateway_flood.py --flood-cpus 1 --label pinned   # attacker on its own cpu

Starts the real mesh (redis-server, kvstore, safety, engine with stories260K, gateway). A victim
tenant calls ListModels `--calls` times in a row, first with the gateway idle, then while
`--flooders` processes send Generate calls from another tenant (limited to 1 request/s, as in
the attack) as fast as the gateway answers: half carry a `--huge-mb` prompt (beyond the gRPC
receive limit), half a prompt just over THERMOCLINE_GATEWAY_MAX_PROMPT_BYTES (refused by the
gateway's checks). Requests are serialized once, up front, so the flooders spend their CPU on
sending, not on protobuf. The figure of merit is the victim's p99 under flood over its p99 idle;
the target is at most 2. Beside it, the gateway process's CPU time per refused call (from
/proc/<pid>/stat): on a shared 2-cpu box the p99 ratio moves with the neighbours, the CPU cost
of a refusal much less.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from services.cli.client import call_metadata  # noqa: E402
from services.cli.mesh import Mesh, MeshConfig, Ports  # noqa: E402
from services.engine.model.registry import resolve_model  # noqa: E402

try:  # a tree from before the prompt limit existed still runs this benchmark, for a before/after
    from services.gateway.request_bounds import RequestBounds

    MAX_PROMPT_BYTES = RequestBounds().max_prompt_bytes
except ImportError:
    MAX_PROMPT_BYTES = 512 * 1024
from services.gateway.tokens import mint_token  # noqa: E402
from thermocline.gateway.v1 import gateway_pb2 as pb  # noqa: E402
from thermocline.gateway.v1 import gateway_pb2_grpc  # noqa: E402

TENANTS = {
    "defaults": {"requests_per_s": 1e6, "burst_requests": 10**6, "tokens_per_min": 10**12},
    "tenants": {"flood": {"requests_per_s": 1, "burst_requests": 1}},
}
GENERATE = "/thermocline.gateway.v1.GatewayService/Generate"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def start_mesh(state_dir: Path) -> Mesh:
    """The mesh, with the flooding tenant held to 1 request/s."""
    tenants = state_dir / "tenants.json"
    tenants.parent.mkdir(parents=True, exist_ok=True)
    tenants.write_text(json.dumps(TENANTS))
    env = {"THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants), "THERMOCLINE_LOG_LEVEL": "WARNING"}
    mesh = Mesh(
        MeshConfig(model=str(resolve_model("stories260k")), state_dir=state_dir, ports=Ports.free(), env=env)
    )
    mesh.start()
    return mesh


def victim_latencies_ms(target: str, bearer: str, num_calls: int) -> list[float]:
    """ListModels, one call after another; each call's wall time."""
    latencies = []
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for _ in range(num_calls):
            started = time.perf_counter()
            stub.ListModels(pb.ListModelsRequest(), metadata=call_metadata(bearer), timeout=120)
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def flood(
    target: str, bearer: str, huge_bytes: int, over_bytes: int, cpus: set[int], stop: object, results: object
) -> None:
    """One flooding process: oversized Generate calls until `stop` is set; counts codes and latencies."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    payloads = [
        pb.GenerateRequest(prompt="a" * size).SerializeToString() for size in (huge_bytes, over_bytes)
    ]
    codes: collections.Counter[str] = collections.Counter()
    refusal_ms: list[float] = []
    options = [("grpc.max_send_message_length", huge_bytes + 1024)]
    with grpc.insecure_channel(target, options=options) as channel:
        generate = channel.unary_stream(GENERATE)  # bytes in, bytes out: no protobuf work per call
        number = 0
        while not stop.is_set():  # type: ignore[attr-defined]
            started = time.perf_counter()
            try:
                list(generate(payloads[number % 2], metadata=call_metadata(bearer), timeout=120))
                codes["OK"] += 1
            except grpc.RpcError as error:
                codes[error.code().name] += 1
            refusal_ms.append((time.perf_counter() - started) * 1000)
            number += 1
    results.put((dict(codes), refusal_ms))  # type: ignore[attr-defined]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(mesh: Mesh, args: argparse.Namespace) -> dict[str, object]:
    """Idle, then flooded, victim latencies, the gateway's CPU time in each phase, and what the flood got."""
    key = mesh.private_key_path.read_bytes()
    victim = mint_token(key, subject="victim", tenant="victim")
    attacker = mint_token(key, subject="attacker", tenant="flood", extra_claims={"roles": []})
    target = mesh.target("gateway")
    victim_latencies_ms(target, victim, 20)  # warm-up: channels, model info, caches
    gateway = mesh.processes["gateway"].pid
    cpu_before = cpu_s(gateway)
    idle = victim_latencies_ms(target, victim, args.calls)
    cpu_idle = cpu_s(gateway) - cpu_before
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    over_bytes = MAX_PROMPT_BYTES + 1024
    flooders = [
        context.Process(
            target=flood,
            args=(target, attacker, int(args.huge_mb * 2**20), over_bytes, args.flood_cpus, stop, results),
        )
        for _ in range(args.flooders)
    ]
    cpu_before = cpu_s(gateway)
    for process in flooders:
        process.start()
    time.sleep(args.ramp_s)  # benchmark pacing, not synchronisation: let the flood reach full rate
    flooded = victim_latencies_ms(target, victim, args.calls)
    stop.set()
    codes: collections.Counter[str] = collections.Counter()
    refusal_ms: list[float] = []
    for _ in flooders:
        got_codes, got_ms = results.get(timeout=300)
        codes.update(got_codes)
        refusal_ms += got_ms
    for process in flooders:
        process.join(60)
    cpu_flooded = cpu_s(gateway) - cpu_before  # the whole flood: ramp, victim calls, last calls
    return {
        "idle": idle,
        "flooded": flooded,
        "codes": dict(codes),
        "refusal_ms": refusal_ms,
        "gateway_cpu_s": (cpu_idle, cpu_flooded),
    }


def machine() -> dict[str, str]:
    """CPU, commit and versions for the results file."""
    cpu = cpu_name()
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    commit = commit or f"{os.environ.get('THERMOCLINE_BENCH_COMMIT', 'unknown')} (exported tree)"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "git commit": commit + (" (dirty tree)" if dirty.stdout.strip() else ""),
        "cpu": cpu,
        "logical cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "load average at start (1, 5, 15 min)": ", ".join(f"{v:.1f}" for v in os.getloadavg()),
    }


def report(args: argparse.Namespace, result: dict[str, object]) -> str:
    """The results as markdown; the verdict line is computed from the run."""
    idle, flooded = result["idle"], result["flooded"]
    assert isinstance(idle, list) and isinstance(flooded, list)
    refusal_ms = result["refusal_ms"]
    assert isinstance(refusal_ms, list)
    ratio = percentile(flooded, 99) / percentile(idle, 99)
    settings = machine() | {
        "victim": f"ListModels x {args.calls}, sequential, tenant with high limits",
        "flood": (
            f"{args.flooders} processes, Generate back to back, tenant at 1 request/s; "
            f"alternating {args.huge_mb:g} MiB prompts and prompts 1 KiB over the "
            f"{MAX_PROMPT_BYTES} B limit"
        ),
        "flood ramp": f"{args.ramp_s:g} s before the victim's flooded calls",
        "cpu placement": (
            f"flooders pinned to cpus {sorted(args.flood_cpus)}, the mesh and the victim to the others"
            if args.flood_cpus
            else "flooders, mesh and victim share every cpu"
        ),
        "mesh": "redis-server, kvstore, safety, engine (stories260K, CPU), gateway; all on this machine",
    }
    lines = ["# Gateway under a flood of oversized prompts", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    lines += ["", "## The victim's ListModels latency", "", "| phase | p50 ms | p99 ms | max ms |"]
    lines += ["| --- | --- | --- | --- |"]
    for name, values in (("idle", idle), ("under flood", flooded)):
        lines.append(
            f"| {name} | {percentile(values, 50):.2f} | {percentile(values, 99):.2f} | {max(values):.2f} |"
        )
    verdict = "meets" if ratio <= 2 else "misses"
    lines += [
        "",
        f"p99 under flood / p99 idle = **{ratio:.2f}**; this run {verdict} the target of at most 2.",
    ]
    lines += ["", "## What the flood got", "", "| status | calls |", "| --- | --- |"]
    lines += [f"| {code} | {count} |" for code, count in sorted(result["codes"].items())]  # type: ignore[union-attr]
    lines += [
        "",
        f"Flood call latency (refusal included): p50 {percentile(refusal_ms, 50):.1f} ms, "
        f"p99 {percentile(refusal_ms, 99):.1f} ms, over {len(refusal_ms)} calls.",
        *gateway_cpu_lines(args, result, len(refusal_ms)),
    ]
    return "\n".join(lines) + "\n"


def gateway_cpu_lines(args: argparse.Namespace, result: dict[str, object], num_flood_calls: int) -> list[str]:
    """What the gateway process spent (CPU time, all threads) in each phase, and per refused call.

    Machine noise moves the victim's p99 by 2x on its own; CPU time per call is the steadier
    measure of what a refusal costs the gateway. The flood's share is the flooded phase's CPU time
    (from the first flooder's start to the last one's end) less the victim's calls at their idle cost.
    """
    cpu_idle, cpu_flooded = result["gateway_cpu_s"]  # type: ignore[misc]
    per_victim_ms = cpu_idle / args.calls * 1000
    flood_cpu_s = cpu_flooded - cpu_idle
    per_refusal_ms = flood_cpu_s / max(1, num_flood_calls) * 1000
    return [
        "",
        "## The gateway's CPU time (user + system, all threads)",
        "",
        "| phase | CPU s | calls | CPU ms per call |",
        "| --- | --- | --- | --- |",
        f"| idle | {cpu_idle:.2f} | {args.calls} victim | {per_victim_ms:.2f} |",
        f"| flooded (ramp to last flood call) | {cpu_flooded:.2f} | {args.calls} victim + "
        f"{num_flood_calls} flood | {per_refusal_ms:.2f} per flood call (less the victim's idle cost) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--flooders", type=int, default=4)
    parser.add_argument("--huge-mb", type=float, default=10.0)
    parser.add_argument("--ramp-s", type=float, default=2.0)
    parser.add_argument(
        "--flood-cpus",
        type=lambda text: {int(cpu) for cpu in text.split(",")},
        default=set(),
        help="pin the flooders to these cpus (e.g. 1) and everything else to the rest, as if the "
        "attacker's clients ran elsewhere; default: all share every cpu",
    )
    parser.add_argument("--label", default="", help="a suffix for the results file name")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.flood_cpus:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - args.flood_cpus)  # the mesh inherits it
    with tempfile.TemporaryDirectory() as state, start_mesh(Path(state)) as mesh:
        result = measure(mesh, args)
    text = report(args, result)
    print(text)
    if not args.no_write:
        suffix = f"_{args.label}" if args.label else ""
        path = REPO / "bench" / "results" / f"gateway_flood_{dt.date.today().isoformat()}{suffix}.md"
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
