"""Real parts for the kvstore's tests: a redis-server, kvstore processes, and blocks to store."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.cli.mesh import free_port
from services.common.kvstore_api import KVStoreClient
from services.common.service_auth import (
    TOKEN_FILE_SETTING,
    ServiceToken,
    authenticated,
    ensure_token_file,
    read_token,
)
from services.kvstore.blocks import BlockIn, Codec
from services.kvstore.config import StoreConfig
from services.kvstore.keys import BlockHash, Namespace
from services.kvstore.store import BlockStore

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0


@dataclass
class RedisServer:
    """A redis-server on a free loopback port, with no persistence (a restart loses everything).

    `binary` names the program to run (a carried one, e.g. `tools/carry_redis.sh`'s wrapper, on a
    machine without Redis); None takes `redis-server` from the PATH and skips the test without it.
    """

    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    binary: Path | None = None

    @property
    def url(self) -> str:
        """REDIS_URL for a service."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A client for the test's own checks and faults."""
        return redis.Redis(port=self.port, socket_connect_timeout=1)

    def start(self) -> RedisServer:
        """Starts the server and waits until it answers PING."""
        command = [
            self._program(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.directory / "redis.log").read_text()
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.02)  # back off between PINGs while it binds its port
        raise TimeoutError(f"redis-server did not answer PING on {self.port}")

    def stop(self) -> None:
        """Stops the server."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def restart(self) -> RedisServer:
        """Stops and starts the server on its port. It saves nothing on the way down, so it comes
        back with the snapshot of its last SAVE (`dump.rdb` in `directory`), or empty without one:
        what a production Redis that persists RDB snapshots does after a crash or a move."""
        self.stop()
        return self.start()

    def _program(self) -> str:
        """The absolute path to run (the server starts in `directory`, where a relative one would miss)."""
        if self.binary is not None:
            if not os.access(self.binary, os.X_OK):
                raise FileNotFoundError(
                    f"redis-server binary {self.binary} does not exist or is not executable"
                )
            return str(self.binary.resolve())
        found = shutil.which("redis-server")
        if found is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        return found


@dataclass
class KVStoreProcess:
    """`python -m services.kvstore` on free loopback ports, over one data dir and one Redis."""

    data_dir: Path
    redis_url: str
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_dir: Path | None = None  # None: beside the data dir (give another where that disk fills up)
    # The mesh's shared secret (service_auth.py), made beside the log; every call the test's
    # client() and channel() make carries it, as the engine's do.
    service_token_path: Path | None = None

    def __post_init__(self) -> None:
        if self.service_token_path is None:
            self.service_token_path = ensure_token_file(
                (self.log_dir or self.data_dir.parent) / "service.token"
            )

    @property
    def target(self) -> str:
        """host:port of its gRPC endpoint."""
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where its output goes (appended across restarts)."""
        return (self.log_dir or self.data_dir.parent) / f"{self.data_dir.name}.log"

    def start(self) -> KVStoreProcess:
        """Starts the process and waits until its health check says SERVING."""
        self._launch()
        self._wait_serving()
        return self

    def start_or_exit(self) -> int | None:
        """Starts the process; its exit code if it exits before it serves, None once it serves."""
        self._launch()
        try:
            self._wait_serving()
        except AssertionError:
            assert self.process is not None
            exit_code = self.process.poll()
            if exit_code is None:
                raise
            return exit_code
        return None

    def _launch(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("THERMOCLINE_", "OTEL_"))}
        env |= {
            "THERMOCLINE_KVSTORE_PORT": str(self.port),
            "THERMOCLINE_KVSTORE_METRICS_PORT": "0",
            "THERMOCLINE_KVSTORE_DATA_DIR": str(self.data_dir),
            "THERMOCLINE_KVSTORE_GRACE_S": "2",
            "REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
            TOKEN_FILE_SETTING: str(self.service_token_path),
        } | self.env
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.process is not None and self.process.poll() is None, self.log_tail()
                try:
                    for reply in stub.Watch(
                        health_pb2.HealthCheckRequest(), timeout=1.0, wait_for_ready=True
                    ):
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.RpcError as error:
                    if error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise
        raise TimeoutError(f"kvstore was not serving after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def wait_health(self, service: str, status: int) -> None:
        """Returns once the health of `service` ("" for the whole server) is `status`."""
        with grpc.insecure_channel(self.target) as channel:
            replies = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=STARTUP_TIMEOUT_S
            )
            for reply in replies:
                if reply.status == status:
                    replies.cancel()
                    return
        raise AssertionError(f"the health of {service!r} never became {status}")

    def health(self, service: str) -> int:
        """The health of `service` now."""
        with grpc.insecure_channel(self.target) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status)

    def kill(self) -> None:
        """SIGKILL: no drain, no fsync on the way out."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM, then a wait for the drain."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def log_tail(self, num_lines: int = 40) -> str:
        """The end of its log."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-num_lines:])

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of its /metrics (start it with `with_metrics`); None when it has none."""
        port = self.env["THERMOCLINE_KVSTORE_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def client(
        self, tenant: str = "tenant-a", model: str = "tiny-llama", chunk_bytes: int = 4096
    ) -> KVStoreClient:
        """A client for one namespace; small chunks by default, so test blocks span several."""
        return KVStoreClient(
            self.target,
            Namespace(tenant, model),
            chunk_bytes=chunk_bytes,
            timeout_s=60,
            service_token=self.service_token,
        )

    @property
    def service_token(self) -> ServiceToken:
        """The token the process requires of its callers."""
        assert self.service_token_path is not None
        return read_token(self.service_token_path)

    def channel(self) -> grpc.Channel:
        """A channel whose calls carry the service token."""
        return authenticated(grpc.insecure_channel(self.target), self.service_token)


def with_metrics(env: dict[str, str]) -> dict[str, str]:
    """`env` with a /metrics port of its own, for a test that waits on the process's metrics."""
    return env | {"THERMOCLINE_KVSTORE_METRICS_PORT": str(free_port())}


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Polls `condition` (a metric, a stat, a file) until it holds; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {timeout_s} s waiting for {what}"
        time.sleep(0.02)  # back off between polls


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB filesystem of its own (a tmpfs; mounting one needs root, so the test is skipped
    without it), for tests of a full disk."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a small disk: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def fill_disk(path: Path) -> None:
    """Writes `path` until the disk is full, down to its last byte (another program filling it)."""
    with path.open("wb", buffering=0) as file:
        for chunk in (b"\0" * 65536, b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    file.write(chunk)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


SMALL_SEGMENTS = {
    "THERMOCLINE_KVSTORE_SEGMENT_MB": "0.01"
}  # 10 KiB: a few blocks fill one, so rotation happens


@pytest.fixture
def kvstore(tmp_path: Path, redis_server: RedisServer) -> Iterator[KVStoreProcess]:
    """A kvstore process of its own, for a test that breaks things (files, Redis, the process)."""
    process = KVStoreProcess(tmp_path / "kvstore", redis_server.url, SMALL_SEGMENTS)
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def shared_kvstore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStoreProcess]:
    """One kvstore and Redis for a module's tests that only call it; they use distinct hashes or tenants."""
    directory = tmp_path_factory.mktemp("shared-kvstore")
    server = RedisServer(directory).start()
    process = KVStoreProcess(directory / "kvstore", server.url, SMALL_SEGMENTS)
    yield process.start()
    process.stop()
    server.stop()


def block_hash(name: str) -> BlockHash:
    """A content hash for a test block."""
    return BlockHash(hashlib.sha256(name.encode()).hexdigest())


def raw_block(name: str, num_values: int = 3000) -> BlockIn:
    """A CODEC_RAW block whose bytes are derived from its name (so a mix-up is visible)."""
    seed = hashlib.sha256(name.encode()).digest()
    payload = (seed * (2 * num_values // len(seed) + 1))[: 2 * num_values]
    return BlockIn(block_hash(name), Codec.RAW, (1, 2, num_values // 2, 1, 1), payload)


def run_store(
    tmp_path: Path,
    redis_server: RedisServer,
    scenario: Callable[[BlockStore], Awaitable[None]],
    **settings: object,
) -> None:
    """Runs `scenario` against a BlockStore opened in this process over real files and `redis_server`."""
    config = StoreConfig(data_dir=tmp_path / "store", capacity_bytes=1 << 30, redis_url=redis_server.url)

    async def main() -> None:
        store = await BlockStore.open(dataclasses.replace(config, **settings))  # type: ignore[arg-type]
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(main())


class HeldCall:
    """Wraps an `os` function (set it with monkeypatch): its first call waits in its thread until
    `release`, then fails with `error` (None: goes through); later calls go straight through.
    A fault at the OS boundary that the test can order against the store's other calls."""

    def __init__(self, call: Callable[..., object], error: OSError | None = None) -> None:
        self.call = call
        self.error = error
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: object) -> object:
        if self.entered.is_set():
            return self.call(*args)
        self.entered.set()
        assert self.release.wait(STARTUP_TIMEOUT_S), "the test never released the held call"
        if self.error is not None:
            raise self.error
        return self.call(*args)

    async def wait_entered(self) -> None:
        """Returns once the first call is being held."""
        assert await asyncio.to_thread(self.entered.wait, STARTUP_TIMEOUT_S), "the call never came"


def eio() -> OSError:
    """What a failed writeback reports."""
    return OSError(errno.EIO, os.strerror(errno.EIO))
