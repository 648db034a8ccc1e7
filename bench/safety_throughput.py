"""Throughput and latency of the safety service under many streams' output screens, by how many
checks it runs at once (THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS).

    .venv/bin/python bench/safety_throughput.py [--settings 1 8 8@cuda] [--concurrency 1 4 16 64]
        [--out bench/results/safety_throughput_<date>.md]

The safety service runs as its own process over real gRPC, once per setting: `N` runs N checks at
once with the encoder on the CPU, `N@cuda` on the GPU (THERMOCLINE_SAFETY_DEVICE). A stream is what the
gateway sends for one completion under the `strict` release: a CheckPrompt of its prompt, then a
CheckOutput of the whole text so far after every `--window-words` words (about 16 tokens), for
`--checks-per-stream` windows. The texts are runs of words from docs/*.md, chosen by a generator
seeded by the level: every setting screens the same texts, and no level the texts of another,
which the embedder's cache of windows would answer. At each concurrency level, that many clients
run streams back to back until `--streams` streams are done; each check's latency is timed at the
client, and checks/s is all checks over the level's wall time. Every verdict and score of a setting
is compared with the first setting's.

The head-of-line part (`--long-chat N`): one client screens a chat of N short messages again and
again (a new chat each time, as bench/safety_chat_latency.py builds them), while another sends short
prompt checks one after another; the table gives the short checks' latency. With one check at a
time, a short check waits for the chat's whole check.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name, git_commit  # noqa: E402
from bench.safety_chat_latency import chat_of  # noqa: E402
from services.cli.mesh import Mesh, MeshConfig, Ports  # noqa: E402
from services.common.service_auth import ServiceToken, authenticated_aio, read_token  # noqa: E402
from thermocline.safety.v1 import safety_pb2 as pb  # noqa: E402
from thermocline.safety.v1 import safety_pb2_grpc as pb_grpc  # noqa: E402

PROMPTS = (
    "Write a short summary of how this service is configured.",
    "Explain the following notes to a new engineer.",
    "What does this part of the documentation say about limits?",
    "Rewrite this paragraph in plain English.",
)


@dataclass
class Stream:
    """One completion's checks: its prompt, then its text after each window."""

    prompt: str
    outputs: list[str]


@dataclass
class LevelResult:
    """One concurrency level of one setting."""

    concurrency: int
    num_checks: int
    wall_s: float
    latencies_s: list[float]
    verdicts: dict[tuple[int, int], tuple[int, tuple[float, ...]]] = field(default_factory=dict)

    @property
    def checks_per_s(self) -> float:
        return self.num_checks / self.wall_s


def streams(num_streams: int, checks_per_stream: int, window_words: int, seed: int = 0) -> list[Stream]:
    """The same streams for every setting: runs of words from the project's docs."""
    words = " ".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md"))).split()
    rng = random.Random(seed)
    out = []
    for _ in range(num_streams):
        start = rng.randrange(len(words) - window_words * checks_per_stream)
        run = words[start : start + window_words * checks_per_stream]
        outputs = [" ".join(run[: window_words * (n + 1)]) for n in range(checks_per_stream)]
        out.append(Stream(rng.choice(PROMPTS), outputs))
    return out


@contextmanager
def safety_service(setting: str) -> Iterator[Mesh]:
    """The safety service alone, as the tests start it, with the given setting (N or N@device)."""
    max_concurrent_checks, _, device = setting.partition("@")
    with tempfile.TemporaryDirectory(prefix="safety-throughput-") as state:
        env = {
            "THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS": max_concurrent_checks,
            "THERMOCLINE_SAFETY_DEVICE": device or "cpu",
        }
        mesh = Mesh(MeshConfig(model="unused", state_dir=Path(state), ports=Ports.free(), env=env))
        mesh.logs_dir.mkdir(parents=True, exist_ok=True)
        mesh.start_service("safety")
        try:
            yield mesh
        finally:
            mesh.stop()


def gpu_name() -> str:
    """The GPU the `@cuda` settings ran on, or that there was none."""
    import torch

    return f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"


def resident_mib(pid: int) -> float:
    """The process's resident memory, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _scores(reply: pb.CheckResponse) -> tuple[float, ...]:
    return tuple(round(s.score, 4) for s in reply.scores)


def channel(address: str, token: ServiceToken) -> grpc.aio.Channel:
    """An asyncio channel that carries the mesh's service token, as the gateway's does."""
    return authenticated_aio(grpc.aio.insecure_channel(address), token)


async def run_level(
    address: str, token: ServiceToken, all_streams: list[Stream], concurrency: int
) -> LevelResult:
    """`concurrency` clients screen the streams, each taking the next one when it is done."""
    latencies: list[float] = []
    verdicts: dict[tuple[int, int], tuple[int, tuple[float, ...]]] = {}
    queue = list(enumerate(all_streams))
    queue.reverse()
    async with channel(address, token) as aio_channel:
        stub = pb_grpc.SafetyServiceStub(aio_channel)

        async def timed(key: tuple[int, int], call: object) -> None:
            started = time.perf_counter()
            reply = await call  # type: ignore[misc]
            latencies.append(time.perf_counter() - started)
            verdicts[key] = (reply.decision, _scores(reply))

        async def client() -> None:
            while queue:
                number, stream = queue.pop()
                await timed(
                    (number, -1), stub.CheckPrompt(pb.CheckPromptRequest(text=stream.prompt), timeout=120)
                )
                for n, text in enumerate(stream.outputs):
                    request = pb.CheckOutputRequest(text=text, prompt=stream.prompt)
                    await timed((number, n), stub.CheckOutput(request, timeout=120))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    return LevelResult(concurrency, len(latencies), wall_s, latencies, verdicts)


async def head_of_line(
    address: str, token: ServiceToken, chat_messages: int, num_short: int
) -> tuple[list[float], int]:
    """Short prompt checks' latencies while long chats are screened back to back beside them;
    returns them and how many long chats were screened."""
    short_latencies: list[float] = []
    num_long = 0
    async with channel(address, token) as aio_channel:
        stub = pb_grpc.SafetyServiceStub(aio_channel)
        finished = asyncio.Event()

        async def long_chats() -> None:
            nonlocal num_long
            while not finished.is_set():
                turns, roles = chat_of(chat_messages, seed=1000 + num_long)
                text = "\n".join(f"{role}: {turn}" for role, turn in zip(roles, turns, strict=True))
                request = pb.CheckPromptRequest(text=text, turns=turns, roles=roles)
                await stub.CheckPrompt(request, timeout=300)
                num_long += 1

        async def short_checks() -> None:
            await stub.CheckPrompt(pb.CheckPromptRequest(text="warm-up"), timeout=60)
            for n in range(num_short):
                started = time.perf_counter()
                await stub.CheckPrompt(pb.CheckPromptRequest(text=f"{PROMPTS[n % 4]} ({n})"), timeout=300)
                short_latencies.append(time.perf_counter() - started)
            finished.set()

        await asyncio.gather(long_chats(), short_checks())
    return short_latencies, num_long


def pct_ms(seconds: list[float], q: int) -> float:
    return statistics.quantiles([s * 1000 for s in seconds], n=100, method="inclusive")[q - 1]


def cells(seconds: list[float]) -> str:
    """p50 and p99 in ms, as two table cells."""
    return f"{pct_ms(seconds, 50):.1f} | {pct_ms(seconds, 99):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", default=["1", "8"], help="N or N@device, e.g. 8@cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--streams", type=int, default=64, help="streams per level (at least the concurrency)"
    )
    parser.add_argument("--checks-per-stream", type=int, default=8)
    parser.add_argument("--window-words", type=int, default=12, help="words per output window (~16 tokens)")
    parser.add_argument(
        "--long-chat", type=int, default=300, help="messages of the head-of-line chat; 0: skip"
    )
    parser.add_argument("--short-checks", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    started_at = datetime.datetime.now(datetime.UTC)
    results: dict[str, list[LevelResult]] = {}
    hol: dict[str, tuple[list[float], int]] = {}
    memory: dict[str, float] = {}
    for setting in args.settings:
        with safety_service(setting) as mesh:
            address, token = mesh.target("safety"), read_token(mesh.service_token_path)
            results[setting] = []
            for concurrency in args.concurrency:
                # texts of their own per level (the embedder's cache would answer a level that
                # repeats another's), the same per setting
                num_streams = max(args.streams, concurrency)
                level_streams = streams(num_streams, args.checks_per_stream, args.window_words, concurrency)
                level = asyncio.run(run_level(address, token, level_streams, concurrency))
                results[setting].append(level)
                print(
                    f"setting {setting}, {concurrency:3d} clients: {level.checks_per_s:6.1f} checks/s, "
                    f"p50 / p99 {cells(level.latencies_s)} ms",
                    flush=True,
                )
            if args.long_chat:
                hol[setting] = asyncio.run(head_of_line(address, token, args.long_chat, args.short_checks))
                print(
                    f"setting {setting}, short checks beside {args.long_chat}-message chats: "
                    f"p50 {pct_ms(hol[setting][0], 50):.1f} ms, p99 {pct_ms(hol[setting][0], 99):.1f} ms",
                    flush=True,
                )
            memory[setting] = resident_mib(mesh.processes["safety"].pid)

    first = args.settings[0]
    lines = [
        f"# Safety service throughput by checks at once, {started_at:%Y-%m-%d}",
        "",
        f"- date: {started_at:%Y-%m-%d %H:%M} UTC; commit `{git_commit('services', 'bench')}`",
        f"- hardware: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.machine()}; {gpu_name()}; "
        f"load average at the end {os.getloadavg()[0]:.1f}",
        "- command: `.venv/bin/python bench/safety_throughput.py "
        f"--settings {' '.join(map(str, args.settings))} "
        f"--concurrency {' '.join(map(str, args.concurrency))} --streams {args.streams} "
        f"--checks-per-stream {args.checks_per_stream} --window-words {args.window_words} "
        f"--long-chat {args.long_chat} --short-checks {args.short_checks}`",
        "- a stream: one CheckPrompt, then a CheckOutput of the whole text so far after every "
        f"{args.window_words} words ({args.checks_per_stream} windows); texts from docs/*.md, seeded",
        "",
        "## Checks per second and latency at the client",
        "",
        "| checks at once @ encoder device (setting) | clients | checks | checks/s | p50 ms | p99 ms "
        f"| verdicts differing from setting {first} | largest score difference |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setting in args.settings:
        for level, base in zip(results[setting], results[first], strict=True):
            differing = sum(level.verdicts[k][0] != base.verdicts[k][0] for k in base.verdicts)
            largest = max(
                max(
                    (abs(a - b) for a, b in zip(level.verdicts[k][1], base.verdicts[k][1], strict=True)),
                    default=0.0,
                )
                for k in base.verdicts
            )
            lines.append(
                f"| {setting} | {level.concurrency} | {level.num_checks} | {level.checks_per_s:.1f} | "
                f"{cells(level.latencies_s)} | {differing} | {largest:.4f} |"
            )
    if hol:
        lines += [
            "",
            f"## Short prompt checks beside {args.long_chat}-message chats screened back to back",
            "",
            "| checks at once @ encoder device (setting) | short checks | p50 ms | p99 ms "
            "| long chats screened meanwhile |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for setting, (latencies, num_long) in hol.items():
            lines.append(f"| {setting} | {len(latencies)} | {cells(latencies)} | {num_long} |")
    lines += [
        "",
        "Resident memory of the service at the end: "
        + ", ".join(f"setting {s}: {m:.0f} MiB" for s, m in memory.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
