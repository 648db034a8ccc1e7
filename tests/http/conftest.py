"""Gateways with their HTTP front on the open mesh, with the RBAC and tenant files these tests need,
and raw-socket helpers for what no client library sends."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.mesh import Mesh, free_port
from services.gateway.audit_chain import segment_paths
from tests.conftest import UNLIMITED_TENANTS
from tests.gateway.conftest import client_request_id as client_request_id_of_event
from tests.gateway.conftest import token, write_policy_files

# One request per ~17 minutes after the first: the second call of this tenant is always refused.
TIGHT_TENANT = {"requests_per_s": 0.001, "burst_requests": 1}
# Tenants with TIGHT_TENANT's limits, one per test that spends a bucket (Redis outlives a gateway).
TIGHT_TENANTS = ("tight", "tight-bodies", "tight-once", "tight-prompt")
HTTP_GATEWAY = "gateway-http"
STRICT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class HttpGateway:
    """The mesh, the HTTP front's base URL (…/v1), and tokens for each kind of caller."""

    mesh: Mesh
    base_url: str
    user_token: str
    reader_token: str
    name: str = HTTP_GATEWAY
    metrics_port: int = 0  # 0: its /metrics is not served

    @property
    def root_url(self) -> str:
        """The URL without /v1, where /health and /ready live."""
        return self.base_url.removesuffix("/v1")

    def token(self, **claims: object) -> str:
        """A token with other claims (tenant, roles, ...)."""
        return token(self.mesh, **claims)

    @property
    def address(self) -> tuple[str, int]:
        """The HTTP front's host and port, for raw sockets."""
        url = urlsplit(self.base_url)
        assert url.hostname is not None and url.port is not None
        return url.hostname, url.port

    def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> Answer:
        """POSTs raw body bytes (what a client library would refuse to send) under /v1."""
        return self.call("POST", path, body, headers)

    def call(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> Answer:
        """One request under /v1, as the user unless `headers` says otherwise ("" drops a header)."""
        fields = {"Authorization": f"Bearer {self.user_token}", "X-Intent": "chat"} | dict(headers or {})
        connection = http.client.HTTPConnection(*self.address, timeout=60)
        try:
            connection.request(method, f"/v1{path}", body, {k: v for k, v in fields.items() if v})
            response = connection.getresponse()
            return Answer(response.status, json.loads(response.read()), dict(response.getheaders()))
        finally:
            connection.close()

    def log(self) -> str:
        """Everything the gateway process has logged."""
        return (self.mesh.logs_dir / f"{self.name}.log").read_text(errors="replace")

    def num_handled(self, route: str, code: int) -> float:
        """thermocline_gateway_http_requests_total for one route and status code, from /metrics."""
        assert self.metrics_port, "this gateway's /metrics is not served"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            families = text_string_to_metric_families(response.read().decode())
        wanted = {"route": route, "code": str(code)}
        return sum(
            sample.value
            for family in families
            for sample in family.samples
            if sample.name == "thermocline_gateway_http_requests_total" and sample.labels == wanted
        )

    def audit_events(self, client_request_id: str) -> list[dict[str, Any]]:
        """This gateway's audit decisions about the calls that sent one X-Request-Id, oldest first."""
        directory = self.mesh.config.state_dir / f"audit-{self.name}"
        events = [
            json.loads(line)
            for path in segment_paths(directory, "decisions")
            for line in path.read_text().splitlines()
        ]
        return [event for event in events if client_request_id_of_event(event) == client_request_id]

    def exchange(self, request: bytes, timeout_s: float = 10.0) -> Exchange:
        """Sends raw bytes on a fresh connection and reads until the server closes it, or until
        `timeout_s` passes with nothing more from it (the connection is then still open)."""
        with socket.create_connection(self.address, timeout=timeout_s) as connection:
            connection.sendall(request)
            return read_until_closed(connection)


def read_until_closed(connection: socket.socket) -> Exchange:
    """What the server sends on `connection` until it closes it, or falls silent for the socket's
    timeout."""
    received = bytearray()
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except TimeoutError:
        return Exchange(bytes(received), is_closed=False)
    except ConnectionResetError:
        pass
    return Exchange(bytes(received), is_closed=True)


@dataclass(frozen=True)
class Exchange:
    """The raw bytes a server sent on one connection, and whether it closed that connection."""

    received: bytes
    is_closed: bool

    @property
    def status_lines(self) -> list[str]:
        """The status line of each response sent (a body may run straight into the next one)."""
        return re.findall(r"HTTP/1\.1 \d{3}[^\r\n]*", self.received.decode("latin-1"))


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, the parsed JSON body, headers."""

    status: int
    body: Any
    headers: dict[str, str]

    @property
    def error(self) -> dict[str, Any]:
        """The OpenAI error object of a refusal."""
        return self.body["error"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def http_replica(
    mesh: Mesh, tmp_path_factory: pytest.TempPathFactory, name: str, **settings: str
) -> Iterator[HttpGateway]:
    """A gateway process of its own on `mesh` (so the shared gateway's policy stays as it is),
    with `settings` added to its environment; stopped on exit."""
    tenants = UNLIMITED_TENANTS | {"tenants": dict.fromkeys(TIGHT_TENANTS, TIGHT_TENANT)}
    env = write_policy_files(Path(tmp_path_factory.mktemp(f"{name}-policy")), tenants=tenants)
    # Every refusal written one by one: the tests here read refusals' events by request id, more
    # of them than the audit rate's burst (its sampling: tests/gateway/test_audit_flood.py).
    env |= {
        "THERMOCLINE_GATEWAY_AUDIT_UNAUTHENTICATED_PER_S": "0",
        "THERMOCLINE_GATEWAY_AUDIT_FREE_REFUSALS_PER_S": "0",
    }
    mesh.start_gateway_replica(name, **env, **settings)
    try:
        yield HttpGateway(
            mesh,
            mesh.http_url(name),
            token(mesh, roles=["user"]),
            token(mesh, subject="auditor", roles=["reader"]),
            name,
            int(settings.get("THERMOCLINE_GATEWAY_METRICS_PORT", "0")),
        )
    finally:
        process = mesh.processes.pop(name)
        process.terminate()
        process.wait(60)


@pytest.fixture(scope="package")
def strict_gateway(open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpGateway]:
    """A gateway whose request heads and bodies must come within STRICT_TIMEOUT_S, its /metrics served."""
    settings = {
        "THERMOCLINE_GATEWAY_HTTP_HEADER_TIMEOUT_S": str(STRICT_TIMEOUT_S),
        "THERMOCLINE_GATEWAY_HTTP_BODY_TIMEOUT_S": str(STRICT_TIMEOUT_S),
        "THERMOCLINE_GATEWAY_METRICS_PORT": str(free_port()),
    }
    with http_replica(open_mesh, tmp_path_factory, "gateway-http-strict", **settings) as gateway:
        yield gateway


@pytest.fixture(scope="package")
def http_gateway(open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpGateway]:
    """A second gateway process on the open mesh, with the HTTP front's default limits."""
    with http_replica(open_mesh, tmp_path_factory, HTTP_GATEWAY) as gateway:
        yield gateway
