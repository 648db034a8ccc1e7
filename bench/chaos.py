"""Chaos under load: SIGKILL and restart the gateway, the engine, Redis and the kvstore in turn, N cycles.

    .venv/bin/python bench/chaos.py                  # 12 cycles; writes bench/results/chaos_<date>.md
    .venv/bin/python bench/chaos.py --cycles 3 --no-write

A mesh serving stories260K (tenant limits lifted) takes steady Generate traffic from `--clients`
threads, each sending up to `--rate` requests/s, each request carrying its own x-request-id, while
`--block-writers` threads put small blocks into the kvstore (three per PutBlocks call, up to
`--put-rate` calls/s each). Each cycle SIGKILLs one process (gateway, engine, Redis, kvstore,
safety, in turn), starts it again through Mesh.start_service, waits for its health check, then for the first
Generate that succeeds through the gateway (for the kvstore: the first block put and read back).
A Redis kill loses the kvstore's index (Redis runs without persistence), so the kvstore must
rebuild it from its segments. At the end the report gives:

- acknowledged against found: every request the client saw complete (status OK with its final
  message) must have its audit event in the gateway's log;
- `thermocline audit verify` over the log (hash chains and signed checkpoints);
- requests sent and failed, by status (calls in flight when a process dies fail; that is expected);
- blocks: every block the kvstore acknowledged must read back with its own bytes, and no block it
  serves may differ from what was written (a torn or mixed-up record); corrupt misses are counted;
- per cycle, seconds from the kill until the process served again and until a request succeeded.

tests/cli/test_chaos.py runs one cycle per process of the same code in CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.cli.client import build_request, call_metadata, collect, stream_generate  # noqa: E402
from services.cli.mesh import Mesh, MeshConfig, Ports  # noqa: E402
from services.common.kvstore_api import (  # noqa: E402
    BlockHash,
    BlockIn,
    Codec,
    FetchedBlock,
    KVStoreClient,
    MissReason,
    Namespace,
)
from services.common.service_auth import ServiceToken, read_token  # noqa: E402
from services.engine.model.registry import resolve_model  # noqa: E402
from services.gateway.audit import DECISIONS  # noqa: E402
from services.gateway.audit_chain import segment_paths  # noqa: E402
from services.gateway.tokens import mint_token  # noqa: E402

VICTIMS = ("gateway", "engine", "redis", "kvstore", "safety")
UNLIMITED_TENANT = {
    "defaults": {"requests_per_s": 1e6, "burst_requests": 10**6, "tokens_per_min": 10**12, "max_streams": 0}
}
PROMPT = "Once upon a time"
REQUEST_TIMEOUT_S = 30.0
RECOVERY_TIMEOUT_S = 300.0
BLOCK_NAMESPACE = Namespace("chaos", "stories260k")
BLOCKS_PER_PUT = 3
BLOCK_VALUES = 3000  # BF16 values: 6,000 payload bytes per block
MAX_HASHES_PER_GET = 1024  # under the kvstore's default limit per call


@dataclass(frozen=True)
class Sent:
    """One request of the load and how it ended."""

    request_id: str
    status: str
    started_s: float  # monotonic clock
    ended_s: float


@dataclass(frozen=True)
class Cycle:
    """One kill and what it took to come back."""

    victim: str
    killed_at_s: float  # monotonic clock
    serving_s: float  # from SIGKILL until the restarted process passed its health check
    recovered_s: float  # from SIGKILL until a Generate succeeded through the gateway again

    def overlaps(self, sent: Sent) -> bool:
        """Whether a request was in flight at some moment between the kill and the recovery."""
        return sent.started_s <= self.killed_at_s + self.recovered_s and sent.ended_s >= self.killed_at_s


@dataclass
class Load:
    """Client threads that send Generate calls until stopped, recording every outcome."""

    target: str
    token: str
    num_clients: int
    interval_s: float  # each client sends on this beat (or at once when a call ran longer)
    sent: list[Sent] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        """Starts the client threads."""
        for client in range(self.num_clients):
            thread = threading.Thread(target=self._client, args=(client,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def finish(self) -> list[Sent]:
        """Stops sending, waits for the calls in flight, and returns every outcome."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        return self.sent

    def _client(self, client: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            number, next_s = 0, time.monotonic()
            while not self.stop.wait(max(0.0, next_s - time.monotonic())):  # pacing, not synchronisation
                next_s = max(
                    next_s + self.interval_s, time.monotonic()
                )  # no catch-up burst after a slow call
                request_id = f"chaos-{client}-{number}"
                started_s = time.monotonic()
                status = generate(channel, self.token, request_id)
                self.sent.append(Sent(request_id, status, started_s, time.monotonic()))
                number += 1


def chaos_block(name: str) -> BlockIn:
    """A CODEC_RAW block whose bytes derive from its name, so a torn or mixed-up record shows."""
    seed = hashlib.sha256(name.encode()).digest()
    payload = (seed * (2 * BLOCK_VALUES // len(seed) + 1))[: 2 * BLOCK_VALUES]
    return BlockIn(
        BlockHash(hashlib.sha256(b"block:" + name.encode()).hexdigest()),
        Codec.RAW,
        (1, 2, BLOCK_VALUES // 2, 1, 1),
        payload,
    )


@dataclass
class BlockLoad:
    """Threads that put blocks into the kvstore until stopped, recording what was acknowledged."""

    target: str
    service_token: ServiceToken  # the mesh's: the kvstore serves its services only
    num_writers: int
    interval_s: float  # each writer puts on this beat (or at once when a put ran longer)
    attempted: dict[str, str] = field(default_factory=dict)  # block hash -> block name
    acknowledged: set[str] = field(default_factory=set)
    failed_puts: Counter[str] = field(default_factory=Counter)
    num_puts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> BlockLoad:
        """Starts the writer threads."""
        for writer in range(self.num_writers):
            thread = threading.Thread(target=self._writer, args=(writer,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def finish(self) -> None:
        """Stops writing and waits for the puts in flight."""
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _writer(self, writer: int) -> None:
        token = self.service_token
        with KVStoreClient(
            self.target, BLOCK_NAMESPACE, timeout_s=REQUEST_TIMEOUT_S, service_token=token
        ) as client:
            number, next_s = 0, time.monotonic()
            while not self.stop.wait(max(0.0, next_s - time.monotonic())):  # pacing, not synchronisation
                next_s = max(next_s + self.interval_s, time.monotonic())
                names = [f"chaos-{writer}-{number}-{part}" for part in range(BLOCKS_PER_PUT)]
                self._put(client, names)
                number += 1

    def _put(self, client: KVStoreClient, names: list[str]) -> None:
        blocks = [chaos_block(name) for name in names]
        with self.lock:
            self.attempted |= {b.block_hash: name for b, name in zip(blocks, names, strict=True)}
            self.num_puts += 1
        try:
            result = client.put(blocks)
        except grpc.RpcError as error:
            with self.lock:
                self.failed_puts[error.code().name] += 1
            return
        with self.lock:
            self.acknowledged.update(result.stored + result.duplicates)


@dataclass(frozen=True)
class BlockCheck:
    """Every attempted block read back after the last cycle, judged against what was written."""

    num_puts: int
    failed_puts: Counter[str]
    num_attempted: int
    acknowledged: set[str]
    lost: set[str]  # acknowledged, and not served with its bytes
    torn: set[str]  # served with bytes other than those written
    num_served: int
    num_corrupt: int  # misses the kvstore reported as CORRUPT (a checksum caught them)


def check_blocks(target: str, load: BlockLoad) -> BlockCheck:
    """Reads every block the load tried to put, and compares each served one with its bytes."""
    fetched: dict[str, FetchedBlock | MissReason] = {}
    hashes = sorted(load.attempted)
    token = load.service_token
    with KVStoreClient(target, BLOCK_NAMESPACE, timeout_s=RECOVERY_TIMEOUT_S, service_token=token) as client:
        for start in range(0, len(hashes), MAX_HASHES_PER_GET):
            fetched |= client.get(hashes[start : start + MAX_HASHES_PER_GET])
    served = {h: got for h, got in fetched.items() if isinstance(got, FetchedBlock)}
    torn = {h for h, got in served.items() if got.payload != chaos_block(load.attempted[h]).payload}
    lost = {h for h in load.acknowledged if h not in served} | (load.acknowledged & torn)
    num_corrupt = sum(1 for got in fetched.values() if got is MissReason.CORRUPT)
    return BlockCheck(
        load.num_puts,
        load.failed_puts,
        len(hashes),
        set(load.acknowledged),
        lost,
        torn,
        len(served),
        num_corrupt,
    )


def block_round_trip(target: str, name: str, token: ServiceToken) -> bool:
    """Whether one block can be put and read back with its bytes."""
    block = chaos_block(name)
    try:
        with KVStoreClient(
            target, BLOCK_NAMESPACE, timeout_s=REQUEST_TIMEOUT_S, service_token=token
        ) as client:
            client.put([block])
            got = client.get([block.block_hash])[block.block_hash]
    except grpc.RpcError:
        return False
    return isinstance(got, FetchedBlock) and got.payload == block.payload


def generate(channel: grpc.Channel, token: str, request_id: str) -> str:
    """One short Generate; its status name (OK only when the stream ended with its final message)."""
    metadata = [*call_metadata(token), ("x-request-id", request_id)]
    try:
        request = build_request(PROMPT, max_tokens=8)
        result = collect(stream_generate(channel, request, metadata, REQUEST_TIMEOUT_S))
    except grpc.RpcError as error:
        return error.code().name
    return "OK" if result.done is not None else "NO_FINAL_MESSAGE"


def kill(mesh: Mesh, victim: str) -> None:
    """SIGKILL, and reap the process."""
    process = mesh.processes[victim]
    process.kill()
    process.wait()


def restart(mesh: Mesh, victim: str) -> None:
    """Starts the process again on its old port and waits until it answers its health check."""
    mesh.start_service(victim)


def wait_for_success(mesh: Mesh, token: str, since: float, victim: str) -> float:
    """Seconds from `since` until a Generate succeeds through the gateway (after a kvstore kill: until
    a block is put and read back)."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        number = 0
        while not probe(mesh, channel, token, f"chaos-probe-{since:.3f}-{number}", victim):
            number += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"no request succeeded within {RECOVERY_TIMEOUT_S:g} s of the kill")
    return time.monotonic() - since


def probe(mesh: Mesh, channel: grpc.Channel, token: str, name: str, victim: str) -> bool:
    """One request to the service the victim's outage took away: whether it succeeded."""
    if victim == "kvstore":
        return block_round_trip(mesh.target("kvstore"), name, read_token(mesh.service_token_path))
    return generate(channel, token, name) == "OK"


def run_cycle(mesh: Mesh, token: str, victim: str) -> Cycle:
    """One kill, restart and recovery."""
    killed_at = time.monotonic()
    kill(mesh, victim)
    restart(mesh, victim)
    serving_s = time.monotonic() - killed_at
    return Cycle(victim, killed_at, serving_s, wait_for_success(mesh, token, killed_at, victim))


def audited_request_ids(mesh: Mesh) -> set[str]:
    """The x-request-ids the callers sent with every decision in the gateway's audit log (the
    events' own request_id is the gateway's; the caller's is details.client_request_id)."""
    found = set()
    for path in segment_paths(mesh.audit_dir, DECISIONS):
        for line in path.read_text().splitlines():
            try:
                found.add(json.loads(line).get("details", {}).get("client_request_id", ""))
            except json.JSONDecodeError:  # a torn last line; `audit verify` judges it
                continue
    return found


def audit_verify(mesh: Mesh) -> tuple[int, str]:
    """`thermocline audit verify` over the mesh's audit log: exit status and its last line."""
    command = [sys.executable, "-m", "services.cli.main", "--state-dir", str(mesh.config.state_dir)]
    command += ["audit", "verify"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    lines = (result.stdout + result.stderr).strip().splitlines()
    return result.returncode, lines[-1] if lines else ""


@dataclass(frozen=True)
class ChaosResult:
    """What a chaos run found."""

    cycles: list[Cycle]
    sent: list[Sent]
    acknowledged: set[str]
    lost: set[str]
    verify_status: int
    verify_line: str
    blocks: BlockCheck

    @property
    def failed_by_status(self) -> Counter[str]:
        """Requests that did not end OK, by status."""
        return Counter(s.status for s in self.failed)

    @property
    def failed(self) -> list[Sent]:
        """Requests that did not end OK."""
        return [s for s in self.sent if s.status != "OK"]

    def failed_during(self, cycle: Cycle) -> int:
        """Failed requests that were in flight during this cycle's outage."""
        return sum(1 for s in self.failed if cycle.overlaps(s))

    @property
    def failed_outside_outages(self) -> list[Sent]:
        """Failed requests that overlapped no outage: nothing was down, and still they failed."""
        return [s for s in self.failed if not any(c.overlaps(s) for c in self.cycles)]


def chaos(
    state_dir: Path,
    num_cycles: int,
    num_clients: int,
    rate_per_client: float = 4.0,
    num_block_writers: int = 2,
    put_rate_per_writer: float = 10.0,
) -> ChaosResult:
    """Starts a mesh, runs the cycles under load, checks every block, stops the mesh, checks the audit log."""
    tenants = state_dir / "tenants.json"
    state_dir.mkdir(parents=True, exist_ok=True)
    tenants.write_text(json.dumps(UNLIMITED_TENANT))
    config = MeshConfig(
        model=str(resolve_model("stories260k")),
        state_dir=state_dir,
        ports=Ports.free(),
        env={"THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants)},
        startup_timeout_s=RECOVERY_TIMEOUT_S,
    )
    with Mesh(config) as mesh:
        token = mint_token(mesh.private_key_path.read_bytes(), subject="chaos", tenant="chaos")
        load = Load(mesh.target("gateway"), token, num_clients, 1.0 / rate_per_client).start()
        service_token = read_token(mesh.service_token_path)
        block_load = BlockLoad(
            mesh.target("kvstore"), service_token, num_block_writers, 1.0 / put_rate_per_writer
        ).start()
        try:
            cycles = [run_cycle(mesh, token, VICTIMS[i % len(VICTIMS)]) for i in range(num_cycles)]
        finally:
            sent = load.finish()
            block_load.finish()
        blocks = check_blocks(mesh.target("kvstore"), block_load)
    acknowledged = {s.request_id for s in sent if s.status == "OK"}
    lost = acknowledged - audited_request_ids(mesh)
    verify_status, verify_line = audit_verify(mesh)
    return ChaosResult(cycles, sent, acknowledged, lost, verify_status, verify_line, blocks)


def report(result: ChaosResult, args: argparse.Namespace, wall_s: float) -> str:
    """The markdown report."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    failed = ", ".join(f"{status} {n}" for status, n in result.failed_by_status.most_common()) or "none"
    num_failed = sum(result.failed_by_status.values())
    cycles = [
        "| cycle | killed | serving again after (s) | a request succeeded after (s) | requests failed |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {i + 1} | {c.victim} | {c.serving_s:.1f} | {c.recovered_s:.1f} | {result.failed_during(c)} |"
            for i, c in enumerate(result.cycles)
        ),
    ]
    by_victim = []
    for victim in VICTIMS:
        times = sorted(c.recovered_s for c in result.cycles if c.victim == victim)
        if times:
            by_victim.append(f"{victim}: median {times[len(times) // 2]:.1f} s, worst {times[-1]:.1f} s")
    return "\n".join(
        [
            "# Chaos: SIGKILL and restart under load",
            "",
            "| setting | value |",
            "| --- | --- |",
            f"| date (UTC) | {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} |",
            f"| git commit | {commit.stdout.strip()} |",
            f"| machine | {os.cpu_count()} logical cpus; 1-min load {os.getloadavg()[0]:.1f} at the end |",
            "| mesh | redis-server (no persistence), kvstore, safety, engine (stories260K), gateway; "
            "no tenant limits |",
            f"| load | {args.clients} client threads, each up to {args.rate:g} req/s (a call waits for the "
            f"last), 8-token Generate calls, {REQUEST_TIMEOUT_S:g} s deadline |",
            f"| block load | {args.block_writers} writer threads, each up to {args.put_rate:g} PutBlocks/s "
            f"of {BLOCKS_PER_PUT} CODEC_RAW blocks ({2 * BLOCK_VALUES} payload bytes each), kvstore defaults "
            "(batched fsync) |",
            f"| cycles | {len(result.cycles)} (SIGKILL of {', '.join(VICTIMS)} in turn, then restart) |",
            f"| wall time | {wall_s:.0f} s |",
            "",
            "## Findings",
            "",
            f"- acknowledged requests (OK with a final message): {len(result.acknowledged)}; "
            f"their audit events found: {len(result.acknowledged) - len(result.lost)}; "
            f"lost: {len(result.lost)} {sorted(result.lost)[:10] if result.lost else ''}",
            f"- `thermocline audit verify`: exit {result.verify_status}: {result.verify_line}",
            f"- requests sent: {len(result.sent)}; failed: {num_failed} ({failed}); of those, "
            f"{len(result.failed_outside_outages)} overlapped no outage (after a restart, a client's channel "
            "may still be in its reconnect backoff)",
            *block_findings(result.blocks),
            f"- time to recover (kill to first success; for the kvstore, a block put and read back): "
            f"{'; '.join(by_victim)}",
            "",
            *cycles,
            "",
            f"Reproduce: `.venv/bin/python bench/chaos.py --cycles {args.cycles} --clients {args.clients} "
            f"--rate {args.rate:g} --block-writers {args.block_writers} --put-rate {args.put_rate:g}`",
            "",
        ]
    )


def block_findings(blocks: BlockCheck) -> list[str]:
    """The report's lines on the kvstore's blocks."""
    failed = ", ".join(f"{status} {n}" for status, n in blocks.failed_puts.most_common()) or "none"
    lost = sorted(blocks.lost)[:5]
    return [
        f"- kvstore puts: {blocks.num_puts} calls of {BLOCKS_PER_PUT} blocks; failed: "
        f"{sum(blocks.failed_puts.values())} ({failed}); blocks acknowledged: {len(blocks.acknowledged)} "
        f"of {blocks.num_attempted} attempted",
        f"- kvstore read-back after the last cycle: {blocks.num_served} blocks served; acknowledged and "
        f"lost: {len(blocks.lost)} {lost if lost else ''}; served with bytes other than those written "
        f"(torn or mixed up): {len(blocks.torn)}; misses reported CORRUPT: {blocks.num_corrupt}",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cycles", type=int, default=12, help="kills, rotating over gateway, engine, Redis, kvstore, safety"
    )
    parser.add_argument("--clients", type=int, default=2, help="client threads")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s each client sends, when it can")
    parser.add_argument(
        "--block-writers", type=int, default=2, help="threads putting blocks into the kvstore"
    )
    parser.add_argument("--put-rate", type=float, default=10.0, help="PutBlocks calls/s per writer, at most")
    parser.add_argument("--no-write", action="store_true", help="print the report instead of writing it")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result = chaos(
            Path(tmp) / "chaos", args.cycles, args.clients, args.rate, args.block_writers, args.put_rate
        )
    text = report(result, args, time.monotonic() - started)
    if args.no_write:
        print(text)
    else:
        path = REPO / "bench" / "results" / f"chaos_{dt.datetime.now(dt.UTC):%Y-%m-%d}.md"
        path.write_text(text)
        print(f"wrote {path}")
    blocks_ok = not result.blocks.lost and not result.blocks.torn and result.blocks.acknowledged
    return 0 if not result.lost and result.verify_status == 0 and blocks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
