"""Helpers for the gateway's integration tests: policy files, tokens, calls through a real gateway."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from redis.client import Monitor

from services.cli.client import StreamResult, build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh, free_port
from services.gateway.rate_limiter import TAKE_SCRIPT, bucket_keys
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_PROMPT
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


def write_policy_files(directory: Path, tenants: dict[str, Any] | None = None) -> dict[str, str]:
    """RBAC, intents and tenant files for a test mesh; returns the gateway env that names them."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = {
        "roles": {
            "reader": {"grants": {"*": ["list_models"]}},
            "user": {"inherits": ["reader"], "grants": {"*": ["invoke"]}},
            "admin": {"inherits": ["user"], "grants": {"*": ["admin", "read_audit"]}},
        },
        "role_claim": "roles",
        "bindings": [{"claim": "groups", "value": "ml-platform", "roles": ["admin"]}],
    }
    intents = {
        "default_intent": None,
        "intents": {
            "chat": {"priority_class": "interactive"},
            "code-completion": {"priority_class": "interactive"},
            "batch": {"priority_class": "batch"},
        },
    }
    files = {"POLICY_FILE": policy, "INTENTS_FILE": intents, "TENANTS_FILE": tenants or {}}
    env = {}
    for name, document in files.items():
        path = directory / f"{name.lower()}.json"
        path.write_text(json.dumps(document))
        env[f"THERMOCLINE_GATEWAY_{name}"] = str(path)
    return env


def token(mesh: Mesh, subject: str = "tester", tenant: str = "acme", **claims: object) -> str:
    """A token from the mesh's development key."""
    return mint_token(mesh.private_key_path.read_bytes(), subject=subject, tenant=tenant, extra_claims=claims)


def call(
    target: str,
    bearer: str | None,
    *,
    intent: str | None = None,
    max_tokens: int = 2,
    prompt: str = STORIES_PROMPT,
    extra_metadata: list[tuple[str, str]] | None = None,
) -> StreamResult:
    """One Generate through the gateway at `target`, read to its end."""
    metadata = call_metadata(bearer, intent) + (extra_metadata or [])
    with grpc.insecure_channel(target) as channel:
        return collect(stream_generate(channel, build_request(prompt, max_tokens=max_tokens), metadata, 60))


def refusal(target: str, bearer: str | None, **kwargs: Any) -> grpc.RpcError:
    """The error of a call that must fail."""
    try:
        call(target, bearer, **kwargs)
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call was expected to fail, and it succeeded")


def client_request_id(event: dict[str, Any]) -> str:
    """The `x-request-id` the caller sent with the call an audit event is about ("" for none): the
    event's own `request_id` is the gateway's."""
    return str(event["details"].get("client_request_id", ""))


# A compact JWS whose header and payload are JSON objects: how every JWT in this project begins.
JWT_IN_TEXT = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]*")


def logs_with_a_credential(directory: Path) -> list[str]:
    """The service logs under `directory` that hold a JWT or a bearer token's value."""
    leaking = []
    for path in sorted(directory.rglob("*.log")):
        text = path.read_text(errors="replace")
        if JWT_IN_TEXT.search(text) or re.search(r"Bearer [A-Za-z0-9_-]{16,}", text):
            leaking.append(str(path.relative_to(directory)))
    return leaking


@pytest.fixture(scope="session", autouse=True)
def no_log_of_the_run_carries_a_credential(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """When the session ends, greps every service log the whole run wrote (every test directory's
    meshes live under the session's temporary directory), not only the gateway tests': none may
    hold a token. A leak fails the run as an error in this fixture's teardown."""
    yield
    leaking = logs_with_a_credential(tmp_path_factory.getbasetemp())
    assert not leaking, f"service logs hold a credential: {leaking[:10]}"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of the module's own, on a free loopback port."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (apt-get install redis-server)"
    port = free_port()
    log = (tmp_path_factory.mktemp("redis") / "redis.log").open("wb")
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 30
    while True:  # PING is the server's health check
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(30)


def send(target: str, request: pb.GenerateRequest, metadata: list[tuple[str, Any]]) -> grpc.RpcError | None:
    """One Generate with any request and metadata; its error, or None when it succeeded."""
    with grpc.insecure_channel(target) as channel:
        try:
            collect(pb_grpc.GatewayServiceStub(channel).Generate(request, metadata=metadata, timeout=60))
        except grpc.RpcError as error:
            return error
    return None


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """One header as an HPACK literal without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""

    def length(n: int) -> bytes:  # a 7-bit-prefix integer (RFC 7541 §5.1)
        if n < 127:
            return bytes([n])
        out, n = bytearray([127]), n - 127
        while n >= 128:
            out.append(n % 128 + 128)
            n //= 128
        return bytes([*out, n])

    return b"\x00" + length(len(name)) + name + length(len(value)) + value


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


def raw_grpc_call(target: str, path: str, headers: list[tuple[bytes, bytes]], message: bytes) -> bytes:
    """One gRPC call over a hand-written HTTP/2 connection, for what grpc's client refuses to send
    (a header value that is not UTF-8); returns every byte the server answered until it closed."""
    host, port = target.rsplit(":", 1)
    block = b"".join(
        _hpack_literal(name, value)
        for name, value in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", target.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *headers,
        ]
    )
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            + _frame(4, 0, 0, b"")  # SETTINGS
            + _frame(1, 4, 1, block)  # HEADERS, END_HEADERS
            + _frame(0, 1, 1, body)  # DATA, END_STREAM
        )
        answer = b""
        while b"grpc-status" not in answer and b"\x00\x00\x00\x00\x07" not in answer[-64:]:
            chunk = connection.recv(65536)  # until the status trailer (or a GOAWAY, or EOF)
            if not chunk:
                break
            answer += chunk
            if len(answer) > 1 << 20:
                break
    return answer


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real file system that really fills up (mounting needs root, as in CI)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], check=False
    )
    if mounted.returncode != 0:
        assert os.environ.get("CI") != "true", "CI runs as root and must be able to mount a tmpfs"
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """Writes a filler file until the file system is full; returns it."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as file:
        for size in (65536, 4096, 1):  # down to the last byte
            with contextlib.suppress(OSError):
                while file.write(b"\0" * size):
                    pass
    return filler


@contextlib.contextmanager
def stopped(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """Holds a process stopped (SIGSTOP) for the body, whatever the machine's speed; resumes it after."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def gauge_value(metrics_port: int, name: str) -> float:
    """An unlabelled gauge's value on a process's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


def token_level(mesh: Mesh, tenant: str) -> float:
    """The tokens left in `tenant`'s token bucket in the mesh's redis-server; fails when it has none yet."""
    level = redis.Redis(port=mesh.config.ports.redis).hget(bucket_keys(tenant)[1], "level")
    assert level is not None, f"tenant {tenant} has no token bucket yet"
    return float(level)


@contextlib.contextmanager
def requests_taken(mesh: Mesh, tenant: str) -> Iterator[list[int]]:
    """The requests that each take from `tenant`'s buckets asks for (negative: given back), as
    Redis MONITOR sees the rate limiter's script calls while the block runs; filled in on exit."""
    requests_key = bucket_keys(tenant)[0]
    marker = f"end-of-{uuid.uuid4().hex}"
    client = redis.Redis(port=mesh.config.ports.redis, socket_timeout=30)
    client.script_load(TAKE_SCRIPT)  # else a gateway's first EVALSHA fails NOSCRIPT, shows, and is sent again
    taken: list[int] = []

    def follow(monitor: Monitor) -> None:
        while marker not in (command := monitor.next_command()["command"]):
            # EVALSHA sha 2 requests-key tokens-key ARGV...: TAKE_SCRIPT; ARGV[5], the requests to take
            parts = command.split(" ")
            if parts[0].upper() == "EVALSHA" and parts[2:4] == ["2", requests_key]:
                taken.append(int(parts[9]))

    with client.monitor() as monitor:
        reader = threading.Thread(target=follow, args=(monitor,))
        reader.start()
        try:
            yield taken
        finally:
            client.echo(marker)
            reader.join(30)
    client.close()
    assert not reader.is_alive(), "the MONITOR stream never showed the end marker"
