"""`thermocline loadgen`: the command line of the load generator (formats in README.md beside this file)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli.client import bearer_token, local_state_dir
from services.cli.loadgen.gateway_client import GatewayLoadClient
from services.cli.loadgen.report import LevelResult, report_json, report_markdown
from services.cli.loadgen.runner import CLOSED, OPEN, LevelSpec, warm_up
from services.cli.loadgen.schedule import trace_rate_per_s
from services.cli.loadgen.sla import Sla, parse_sla_flag
from services.cli.loadgen.sweep import run_levels
from services.cli.loadgen.workload import (
    PlannedRequest,
    Workload,
    build_workload,
    load_trace,
    load_workload_file,
    parse_mix,
)
from services.engine.model.registry import DEFAULT_MODEL

# A mesh started for load testing measures the node, not the per-tenant rate limit in front of it.
UNLIMITED_TENANTS = {
    "defaults": {"requests_per_s": 1e6, "burst_requests": 10**6, "tokens_per_min": 10**12, "max_streams": 0}
}


def add_loadgen_parser(commands: Any) -> None:
    """Adds the `loadgen` subcommand to the `thermocline` parser."""
    p = commands.add_parser(
        "loadgen", help="load the gateway and report latency percentiles, or sweep for the SLA knee"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", default="127.0.0.1:50051", help="gateway host:port (default %(default)s)")
    where.add_argument(
        "--start-mesh", action="store_true", help="start a mesh on free loopback ports for the run"
    )
    p.add_argument("--token", help="bearer JWT (default: $THERMOCLINE_TOKEN, else a development token)")
    p.add_argument(
        "--model",
        default=None,
        help=f"model to request; with --start-mesh, to serve (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--mesh-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --start-mesh: a THERMOCLINE_* setting for every service (repeatable), not one the "
        "mesh sets itself (its ports, targets, model, keys and state paths)",
    )
    p.add_argument(
        "--mode", choices=[OPEN, CLOSED], default=OPEN, help="open: Poisson arrivals; closed: fixed clients"
    )
    p.add_argument(
        "--rate",
        type=float,
        help="open loop: arrivals per second (default 1; with --trace, the trace's own pace)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="closed loop: clients (default %(default)s)")
    p.add_argument("--sweep", help="comma-separated loads (rates or client counts), run in increasing order")
    p.add_argument("--full-sweep", action="store_true", help="run every level even after all SLAs failed")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, help="requests per level")
    size.add_argument("--duration-s", type=float, help="seconds of sending per level (default 30)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--mix", help="INTENT=RATIO,... e.g. medical-diagnosis=0.7,code-completion=0.2,default=0.1"
    )
    source.add_argument("--trace", type=Path, help="replay a JSONL trace instead of drawing from a mix")
    p.add_argument("--workload", type=Path, help="TOML file of [class.<intent>] lengths, weights and SLAs")
    p.add_argument("--prompt-tokens", type=int, help="every class: this many prompt words (about tokens)")
    p.add_argument("--output-tokens", type=int, help="every class: max_tokens of each request")
    p.add_argument(
        "--sla",
        action="append",
        default=[],
        metavar="INTENT:KEY=MS,...",
        help="p99 limits, e.g. default:ttft_ms=2000,e2e_ms=20000 (also tpot_ms, max_error_rate)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each request")
    p.add_argument(
        "--warmup", type=int, default=1, help="uncounted requests sent one by one first (default 1)"
    )
    p.add_argument(
        "--json", type=Path, help="write the JSON report here (schema: services/cli/loadgen_schema.json)"
    )
    p.add_argument("--markdown", type=Path, help="write the markdown tables here")
    p.add_argument("--plots", type=Path, metavar="PREFIX", help="write PREFIX_<intent>.png for each class")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_loadgen)


@dataclass(frozen=True)
class RunPlan:
    """What a run sends: a workload or a trace, the classes' SLAs, and the levels."""

    workload: Workload | None
    trace: list[PlannedRequest] | None
    slas: dict[str, Sla]
    specs: list[LevelSpec]

    def warmup_requests(self, num_requests: int, seed: int) -> list[PlannedRequest]:
        """The uncounted requests sent before the first level."""
        if self.trace is not None:
            return [self.trace[i % len(self.trace)] for i in range(num_requests)]
        assert self.workload is not None
        rng = random.Random(f"{seed}:warmup")
        return [self.workload.draw(rng) for _ in range(num_requests)]


@dataclass(frozen=True)
class Target:
    """Where the load goes and as whom."""

    address: str
    token: str
    model: str = ""


def cmd_loadgen(args: argparse.Namespace) -> int:
    """Runs the load generator; exit status 2 on a bad setting, 1 when a started mesh fails."""
    from services.cli.mesh import parse_settings

    try:
        plan = _plan(args)
        mesh_env = parse_settings(args.mesh_env, "--mesh-env")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.start_mesh:
        return _with_mesh(args, plan, mesh_env)
    token = bearer_token(args.token, local_state_dir(args.state_dir), "loadgen", "loadgen")
    target = Target(args.target, token, args.model or "")
    return _run(args, target, plan, {})


def _plan(args: argparse.Namespace) -> RunPlan:
    sla_flags = dict(parse_sla_flag(text) for text in args.sla)
    if args.trace is not None:
        trace = load_trace(args.trace, random.Random(args.seed))
        if stray := set(sla_flags) - {request.intent for request in trace}:
            raise ValueError(f"--sla names classes that are not in the trace: {sorted(stray)}")
        return RunPlan(None, trace, sla_flags, _level_specs(args, trace))
    file_classes = load_workload_file(args.workload) if args.workload else None
    mix = parse_mix(args.mix) if args.mix else None
    workload = build_workload(file_classes, mix, sla_flags, args.prompt_tokens, args.output_tokens)
    return RunPlan(workload, None, workload.slas, _level_specs(args, None))


def _level_specs(args: argparse.Namespace, trace: list[PlannedRequest] | None) -> list[LevelSpec]:
    if args.sweep:
        try:
            loads = [float(item) for item in args.sweep.split(",")]
        except ValueError:
            raise ValueError(f"--sweep {args.sweep!r} is not a comma-separated list of numbers") from None
    else:
        native_rate = trace_rate_per_s(trace) if trace else None
        loads = [(args.rate or native_rate or 1.0) if args.mode == OPEN else float(args.concurrency)]
    duration_s = None if args.num_requests is not None else (args.duration_s or 30.0)
    return [LevelSpec(args.mode, load, args.num_requests, duration_s) for load in loads]


def _with_mesh(args: argparse.Namespace, plan: RunPlan, mesh_env: dict[str, str]) -> int:
    from services.cli.mesh import Mesh, MeshConfig, Ports, ServiceFailed
    from services.gateway.tokens import mint_token

    state_dir = local_state_dir(args.state_dir) / "loadgen-mesh"
    state_dir.mkdir(parents=True, exist_ok=True)
    tenants_path = state_dir / "tenants.json"
    tenants_path.write_text(json.dumps(UNLIMITED_TENANTS))
    config = MeshConfig(
        model=args.model or DEFAULT_MODEL,
        state_dir=state_dir,
        ports=Ports.free(),
        env={"THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants_path), **mesh_env},
    )
    mesh = Mesh(config)
    try:
        mesh.start(progress=not args.no_progress)
    except ServiceFailed as error:
        print(f"error: the mesh did not start: {error}", file=sys.stderr)
        return 1
    with mesh:
        private_key = mesh.private_key_path.read_bytes()
        token = args.token or mint_token(private_key, subject="loadgen", tenant="loadgen")
        mesh_settings = {"started_mesh": True, "mesh_model": config.model, "mesh_env": mesh_env}
        return _run(args, Target(mesh.target("gateway"), token), plan, mesh_settings)


def _run(args: argparse.Namespace, target: Target, plan: RunPlan, extra_settings: dict[str, Any]) -> int:
    settings = _settings(args, target, plan) | extra_settings
    levels = asyncio.run(_drive(args, target, plan))
    document = report_json(settings, levels, plan.slas)
    markdown = report_markdown(levels, plan.slas)
    print(markdown)
    _write_outputs(args, document, markdown, levels, plan.slas)
    return 0


async def _drive(args: argparse.Namespace, target: Target, plan: RunPlan) -> list[LevelResult]:
    client = GatewayLoadClient(target.address, target.token, model=target.model, timeout_s=args.timeout_s)
    try:
        for record in await warm_up(client, plan.warmup_requests(args.warmup, args.seed)):
            if not record.is_ok:
                print(f"warning: a warm-up request failed: {record.status}: {record.error}", file=sys.stderr)
        return await run_levels(
            client,
            plan.specs,
            workload=plan.workload,
            trace=plan.trace,
            slas=plan.slas,
            seed=args.seed,
            stop_when_all_fail=not args.full_sweep,
            show_progress=not args.no_progress,
        )
    finally:
        await client.close()


def _classes_json(workload: Workload | None) -> dict[str, Any]:
    if workload is None:
        return {}
    return {
        spec.intent: {
            "share": workload.shares[spec.intent],
            "prompt_tokens": spec.prompt_tokens.describe(),
            "output_tokens": spec.output_tokens.describe(),
            "chat": spec.chat,
        }
        for spec in workload.classes
    }


def _settings(args: argparse.Namespace, target: Target, plan: RunPlan) -> dict[str, Any]:
    return {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "target": target.address,
        "model": target.model,
        "mode": args.mode,
        "loads": sorted(spec.load for spec in plan.specs),
        "num_requests_per_level": plan.specs[0].num_requests,
        "duration_s_per_level": plan.specs[0].duration_s,
        "source": "trace" if plan.trace is not None else "mix",
        "trace": str(args.trace) if args.trace else None,
        "workload_file": str(args.workload) if args.workload else None,
        "classes": _classes_json(plan.workload),
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "warmup_requests": args.warmup,
    }


def _write_outputs(
    args: argparse.Namespace,
    document: dict[str, Any],
    markdown: str,
    levels: list[LevelResult],
    slas: dict[str, Sla],
) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
    if args.plots:
        from services.cli.loadgen.plots import write_plots

        for path in write_plots(levels, slas, args.plots):
            print(f"wrote {path}", file=sys.stderr)
