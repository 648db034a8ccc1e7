"""SLA calibration on the CPU: a `thermocline loadgen` sweep against a mesh serving SmolLM2-135M-Instruct.

    .venv/bin/python bench/sla_cpu.py               # writes bench/results/sla_cpu_<date>.md, .json, _*.png
    .venv/bin/python bench/sla_cpu.py --levels 0.1,0.2 --duration-s 20 --no-write

It starts the whole mesh (redis-server, kvstore, safety, engine, gateway) on free loopback ports with
per-tenant rate limits lifted, sends open-loop Poisson arrivals of the mix in
bench/loadgen_cpu_workload.toml at each level for `--duration-s` seconds, waits for every request in
flight, and stops after the first level at which every class misses its SLA. The report records the
date, the commit, the hardware and every setting, then the loadgen's own tables and plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from services.cli.main import main as thermocline  # noqa: E402

WORKLOAD = REPO / "bench" / "loadgen_cpu_workload.toml"
MODEL = "smollm2-135m-instruct"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="0.3,0.6,0.9,1.2,1.6,2.0", help="open-loop arrival rates, req/s")
    parser.add_argument("--duration-s", type=float, default=45.0, help="seconds of arrivals per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the report instead of writing it")
    return parser.parse_args()


def git_commit() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "services"], capture_output=True, text=True, cwd=REPO
    )
    return commit.stdout.strip() + (" (services/ has uncommitted changes)" if dirty.stdout.strip() else "")


def hardware_rows() -> list[tuple[str, str]]:
    import grpc
    import torch

    return [
        ("cpu", cpu_name()),
        ("logical cpus", str(os.cpu_count())),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("grpcio", grpc.__version__),
    ]


def run_sweep(args: argparse.Namespace, out_dir: Path) -> dict:
    argv = [
        "--state-dir", str(out_dir / "state"), "loadgen", "--start-mesh", "--model", MODEL,
        "--workload", str(WORKLOAD), "--mode", "open", "--sweep", args.levels,
        "--duration-s", str(args.duration_s), "--seed", str(args.seed), "--timeout-s", "120",
        "--json", str(out_dir / "sweep.json"), "--markdown", str(out_dir / "sweep.md"),
        "--plots", str(out_dir / "plot"),
    ]  # fmt: skip
    if thermocline(argv) != 0:
        raise SystemExit("the loadgen sweep failed; see the messages above")
    return json.loads((out_dir / "sweep.json").read_text())


def settings_rows(document: dict) -> list[tuple[str, str]]:
    settings = document["settings"]
    rows = [
        ("model", f"{MODEL} (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized; engine defaults: CPU, batch 16)"),
        ("mesh", "redis-server, kvstore, safety, engine, gateway on loopback; tenant rate limits lifted"),
        ("mode", "open loop, Poisson arrivals"),
        ("levels (req/s)", ", ".join(f"{load:g}" for load in settings["loads"])),
        (
            "per level",
            f"{settings['duration_s_per_level']:g} s of arrivals, then every request in flight completes",
        ),
        ("warm-up", f"{settings['warmup_requests']} request before the first level, not counted"),
        ("request deadline", f"{settings['timeout_s']:g} s"),
        ("seed", str(settings["seed"])),
        ("workload", "bench/loadgen_cpu_workload.toml"),
    ]
    for intent, spec in settings["classes"].items():
        lengths = (
            f"prompt {describe(spec['prompt_tokens'])} words; max_tokens {describe(spec['output_tokens'])}"
        )
        rows.append((f"class {intent}", f"share {spec['share']:.2f}; {lengths}"))
    return rows


def describe(dist: dict) -> str:
    extra = {k: v for k, v in dist.items() if k != "dist"}
    return dist["dist"] + " (" + ", ".join(f"{k} {v:g}" for k, v in extra.items()) + ")"


def table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| setting | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


def compose(document: dict, sweep_markdown: str, plot_names: list[str], stamp: str) -> str:
    before, after = (document["load_average"][k] for k in ("before", "after"))
    load = f"{before[0]:.1f} before the sweep, {after[0]:.1f} after (15-min average after: {after[2]:.1f})"
    header = [
        ("date (UTC)", stamp),
        ("git commit", git_commit()),
        *hardware_rows(),
        ("load average (1 min)", load),
    ]
    header += settings_rows(document)
    plots = "\n".join(f"![{name}]({name})" for name in plot_names)
    settings = document["settings"]
    levels = ",".join(f"{load:g}" for load in settings["loads"])
    notes = NOTES.format(
        levels=levels, duration_s=settings["duration_s_per_level"], machine=machine_note(before[0], after[2])
    )
    return (
        f"# SLA calibration on the CPU: SmolLM2-135M-Instruct through the whole mesh\n\n{table(header)}\n\n"
        f"{sweep_markdown}\n## Plots\n\n{plots}\n\n## Notes\n\n{notes}"
    )


def machine_note(load_before: float, load_after_15min: float) -> str:
    """What the load averages say about the machine the knee was measured on."""
    cpus = os.cpu_count() or 1
    shared = (
        f"the 1-min load average was {load_before:.1f} before the sweep began, so other work shared the "
        "machine and the knee measures this machine as it was, not a dedicated node"
        if load_before >= 0.5
        else f"the 1-min load average was {load_before:.1f} before the sweep began (a quiet machine)"
    )
    return (
        f"The machine has {cpus} logical CPUs, shared by the load generator and all five mesh processes;\n"
        f"  {shared}. The 15-min average after the sweep was {load_after_15min:.1f}."
    )


NOTES = """\
- Reproduce: `.venv/bin/python bench/sla_cpu.py --levels {levels} --duration-s {duration_s:g}`, or the
  loadgen alone: `thermocline loadgen --start-mesh --workload bench/loadgen_cpu_workload.toml
  --sweep {levels} --duration-s {duration_s:g} --timeout-s 120 --json out.json --markdown out.md --plots out`.
- Latencies are client-side, through the gateway (JWT, RBAC, Redis rate limit, fsynced audit, the
  safety prompt check). The gateway releases text only after the safety service screens it, every
  16 tokens and at the end, so a client's TTFT spans prefill plus the first 16 decode steps (or the
  whole answer when it is shorter) plus one output check, and tokens arrive in bursts of 16; TPOT is
  (E2E - TTFT) / (tokens - 1) per request.
- {machine}
- Each level lasts seconds, not minutes, so a class gets a handful to a few dozen requests per
  level: p99 is close to the maximum, and one slow request moves it. The knee is the highest level
  that passed before the first level that failed (`services/cli/loadgen/sla.py`).
- The SLAs are CPU-scale targets set in the workload file, not product promises.
"""


def main() -> int:
    args = parse_args()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        load_before = os.getloadavg()
        document = run_sweep(args, out_dir)
        document["load_average"] = {"before": load_before, "after": os.getloadavg()}
        date = stamp.split()[0]
        plots = sorted(out_dir.glob("plot_*.png"))
        names = [f"sla_cpu_{date}_{p.stem.removeprefix('plot_')}.png" for p in plots]
        report = compose(document, (out_dir / "sweep.md").read_text(), names, stamp)
        if args.no_write:
            print(report)
            return 0
        results = REPO / "bench" / "results"
        for source, name in zip(plots, names, strict=True):
            shutil.copyfile(source, results / name)
        (results / f"sla_cpu_{date}.json").write_text(
            (out_dir / "sweep.json").read_text()
        )  # the loadgen's own
        (results / f"sla_cpu_{date}.md").write_text(report)
        print(f"wrote {results / f'sla_cpu_{date}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
