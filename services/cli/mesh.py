"""Starting the whole mesh on loopback: redis-server, then kvstore, safety, engine and gateway,
each its own process, each waited on through its health check. `thermocline up`, the demo and
the integration tests all start the mesh through this module."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

from services.common.ports import free_port, port_holders
from services.common.service_auth import TOKEN_FILE_SETTING, authenticated, ensure_token_file, read_token
from services.gateway.audit_checkpoint import ensure_key
from services.gateway.tokens import ensure_dev_keys

log = logging.getLogger(__name__)

SERVICES = ("kvstore", "safety", "engine", "gateway")
AUDIT_KEY_NAME = "audit.key"  # the audit signing key, in the keys directory
SERVICE_TOKEN_NAME = "service.token"  # what the services present to each other, in the keys directory
# The engine's intent classes as deployed (reserved slots, per-class timeouts and tier sizes).
ENGINE_INTENT_CLASSES = Path(__file__).resolve().parents[2] / "deploy" / "engine" / "intent_classes.toml"


@dataclass(frozen=True)
class Ports:
    """Where each process listens."""

    gateway: int = 50051
    engine: int = 50052
    safety: int = 50053
    kvstore: int = 50054
    redis: int = 6390
    gateway_http: int = 8080  # the gateway's OpenAI-compatible HTTP front
    metrics: dict[str, int] = field(
        default_factory=lambda: {"gateway": 9101, "engine": 9102, "safety": 9103, "kvstore": 9104}
    )

    @classmethod
    def free(cls) -> Ports:
        """Ports picked from what is free now, for tests that run beside other meshes."""
        return cls(
            gateway=free_port(),
            engine=free_port(),
            safety=free_port(),
            kvstore=free_port(),
            redis=free_port(),
            gateway_http=free_port(),
            metrics={name: free_port() for name in SERVICES},
        )

    def grpc_port(self, service: str) -> int:
        """The gRPC port of one service."""
        return int(getattr(self, service))


MODEL_LOCATION_SETTINGS = ("THERMOCLINE_SHARED_DIR", "THERMOCLINE_CACHE_DIR")  # see Mesh._service_env
# Set by the mesh only as a default (a source checkout's classes, as compose deploys them): `--env`
# may name other classes.
MESH_DEFAULT_SETTINGS = ("THERMOCLINE_ENGINE_INTENT_CLASSES",)

_PORTS = (
    "the mesh picks its ports (up: gRPC 50051-50054, HTTP 8080, metrics 9101-9104; demo: free ones); "
    "to listen elsewhere, run the services yourself (python -m services.<name>, or compose.yaml)"
)
_WIRING = (
    "the mesh points each service at the others it started; to wire services otherwise, run them "
    "yourself (python -m services.<name>, or compose.yaml)"
)


def _under_state_dir(what: str) -> str:
    return f"{what}, under the state directory: choose that directory with --state-dir"


# What the mesh sets itself, and what changes it instead. `--env` may not replace these: `up` would
# print endpoints the services no longer use, and the gateway would trust another token key or write
# its audit log, signed with another key, where `thermocline audit verify` does not look.
MESH_SETTINGS: dict[str, str] = {
    **{f"THERMOCLINE_{name.upper()}_PORT": _PORTS for name in SERVICES},
    **{f"THERMOCLINE_{name.upper()}_METRICS_PORT": _PORTS for name in SERVICES},
    "THERMOCLINE_GATEWAY_HTTP_PORT": _PORTS,
    "THERMOCLINE_GATEWAY_ENGINE_TARGET": _WIRING,
    "THERMOCLINE_GATEWAY_ENGINE_TARGETS": _WIRING,
    "THERMOCLINE_GATEWAY_SAFETY_TARGET": _WIRING,
    "THERMOCLINE_ENGINE_SAFETY_TARGET": _WIRING,
    "THERMOCLINE_ENGINE_KVSTORE_TARGET": _WIRING,
    "THERMOCLINE_ENGINE_MODEL": "choose the model with --model",
    "THERMOCLINE_GATEWAY_JWT_KEY_FILE": _under_state_dir(
        "the gateway verifies tokens with keys/jwt-public.pem (`thermocline token` signs with its pair)"
    ),
    "THERMOCLINE_GATEWAY_AUDIT_DIR": _under_state_dir("the gateway writes its audit log to audit/"),
    "THERMOCLINE_GATEWAY_AUDIT_KEY_FILE": _under_state_dir(
        f"the gateway signs its audit log with keys/{AUDIT_KEY_NAME} (`thermocline audit verify` reads it)"
    ),
    "THERMOCLINE_KVSTORE_DATA_DIR": _under_state_dir("the kvstore keeps its blocks in kvstore/"),
    TOKEN_FILE_SETTING: _under_state_dir(
        f"the services authenticate to each other with keys/{SERVICE_TOKEN_NAME}"
    ),
}


def parse_settings(items: list[str], flag: str) -> dict[str, str]:
    """`THERMOCLINE_NAME=VALUE` arguments as a mapping for `MeshConfig.env`. The caller's own
    THERMOCLINE_* environment does not reach a mesh's services, so settings are passed this way.
    A setting the mesh makes itself (MESH_SETTINGS) is refused with what changes it instead."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("THERMOCLINE_"):
            raise ValueError(f"{flag} {item!r} is not THERMOCLINE_NAME=VALUE")
        if key in MESH_SETTINGS:
            raise ValueError(f"{flag} {key}=...: the mesh sets {key} itself; {MESH_SETTINGS[key]}")
        settings[key] = value
    return settings


@dataclass(frozen=True)
class MeshConfig:
    """What the mesh runs and where it keeps its state (keys, logs, kvstore data)."""

    model: str
    state_dir: Path
    ports: Ports = field(default_factory=Ports)
    otlp_endpoint: str | None = None
    start_redis: bool = True
    # Extra THERMOCLINE_* settings passed to every service, e.g. a grace period for a test. They win
    # over the mesh's own; the command line's --env cannot name those (parse_settings), code can.
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    # Engine processes behind the gateway; replicas after the first are named engine-2, engine-3, ...
    # and listen on free ports.
    num_engines: int = 1

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"a mesh needs at least one engine, got {self.num_engines}")


class ServiceFailed(RuntimeError):
    """A service exited or never became healthy; the message holds the end of its log."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class _SigtermExit:
    """SIGTERM raises SystemExit while any mesh this process started runs (see Mesh.start), where
    the launcher left SIGTERM at its default; the last mesh to stop puts the default back. During
    a stop SIGTERM is ignored, so that a second one does not cut the stop short."""

    def __init__(self) -> None:
        self.meshes: list[Mesh] = []
        self.before: Any = None

    def hold(self, mesh: Mesh) -> None:
        if not _is_main_thread() or mesh in self.meshes:  # handlers are set in the main thread only
            return
        if not self.meshes:
            if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
                return  # the launcher handles SIGTERM itself
            self.before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self.meshes.append(mesh)

    @contextlib.contextmanager
    def ignored_while_stopping(self, mesh: Mesh) -> Iterator[None]:
        if mesh not in self.meshes or not _is_main_thread():
            yield
            return
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            yield
        finally:
            self.meshes.remove(mesh)
            signal.signal(signal.SIGTERM, handler if self.meshes else self.before)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_SIGTERM = _SigtermExit()


class Mesh:
    """The processes of one mesh; use as a context manager or call start() and stop()."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.keys_dir = config.state_dir / "keys"
        self.logs_dir = config.state_dir / "logs"
        self.private_key_path, self.public_key_path = ensure_dev_keys(self.keys_dir)
        self.audit_key_path = ensure_key(self.keys_dir / AUDIT_KEY_NAME)  # outside the audit directory
        self.service_token_path = ensure_token_file(self.keys_dir / SERVICE_TOKEN_NAME)
        self.audit_dir = config.state_dir / "audit"
        # gRPC ports of the processes that Ports does not name (engine replicas, extra gateways).
        self.extra_ports: dict[str, int] = {
            f"engine-{n}": free_port() for n in range(2, config.num_engines + 1)
        }
        self.extra_http_ports: dict[str, int] = {}  # HTTP fronts of extra gateways
        self.extra_metrics_ports: dict[str, int] = {}  # /metrics of extra services (not gateways)

    @property
    def engine_names(self) -> list[str]:
        """The engine replicas' process names: engine, engine-2, ..."""
        return ["engine", *[f"engine-{n}" for n in range(2, self.config.num_engines + 1)]]

    def __enter__(self) -> Mesh:
        if not self.processes:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def target(self, service: str) -> str:
        """host:port of a service's gRPC endpoint."""
        if service in self.extra_ports:
            return f"127.0.0.1:{self.extra_ports[service]}"
        return f"127.0.0.1:{self.config.ports.grpc_port(service)}"

    def channel(self, service: str) -> grpc.Channel:
        """A blocking channel to a service that carries the mesh's service token, as the services'
        own calls to each other do (the engine, kvstore and safety refuse calls without it)."""
        token = read_token(self.service_token_path)
        return authenticated(grpc.insecure_channel(self.target(service)), token)

    def metrics_url(self, service: str) -> str:
        """The /metrics URL of a service, an extra one (engine-2, a second safety) included."""
        port = self.extra_metrics_ports.get(service) or self.config.ports.metrics[service]
        return f"http://127.0.0.1:{port}/metrics"

    def http_url(self, gateway: str = "gateway") -> str:
        """Base URL of a gateway's OpenAI-compatible front, e.g. http://127.0.0.1:8080/v1."""
        port = self.config.ports.gateway_http if gateway == "gateway" else self.extra_http_ports[gateway]
        return f"http://127.0.0.1:{port}/v1"

    def start(self, progress: bool = False) -> None:
        """Starts everything in dependency order and waits until each is healthy.

        With `progress`, a bar on stderr shows which process the mesh is waiting for (the engine
        takes longest: it loads the model before it reports SERVING).

        The services run in sessions of their own, so a signal to the launcher's process group
        does not reach them; stop() does. Killed by SIGTERM (a `timeout` around a bench, a CI
        job's end), a launcher would die without running it and leave the whole mesh running,
        holding its ports and the GPU's memory. So while the mesh runs, SIGTERM in a launcher
        that did not handle it raises SystemExit, which unwinds through `with Mesh(...)` and
        stop(). SIGKILL cannot be caught: a launcher killed so leaves the mesh behind.
        """
        _SIGTERM.hold(self)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        steps = ["redis", "kvstore", "safety", *self.engine_names, "gateway"]
        with tqdm(total=len(steps), desc="starting", unit="process", disable=not progress) as bar:
            try:
                for step in steps:
                    bar.set_postfix_str(step)
                    self.start_service(step)
                    bar.update()
            except BaseException:
                self.stop()
                raise

    def start_service(self, service: str) -> None:
        """Starts one process ("redis", a service, or an engine replica such as "engine-2") and waits
        until it serves; also how a killed process is restarted on its old port."""
        if service == "redis":
            self._start_redis()
            return
        module = service.split("-", 1)[0]
        env = self._service_env()
        if service in self.extra_ports:
            env[f"THERMOCLINE_{module.upper()}_PORT"] = str(self.extra_ports[service])
            # a port of its own, kept across restarts (metrics_url)
            metrics_port = self.extra_metrics_ports.setdefault(service, free_port())
            env[f"THERMOCLINE_{module.upper()}_METRICS_PORT"] = str(metrics_port)
        self._spawn(service, module, env)

    def start_gateway_replica(self, name: str, **env: str) -> str:
        """Starts another gateway process (sharing Redis, safety and the engines); returns its target.

        `env` adds or overrides THERMOCLINE_* settings for this process only. Its HTTP front
        listens on a free port too (`http_url(name)`).
        """
        self.extra_ports[name] = free_port()
        self.extra_http_ports[name] = free_port()
        settings = self._service_env() | {
            "THERMOCLINE_GATEWAY_PORT": str(self.extra_ports[name]),
            "THERMOCLINE_GATEWAY_HTTP_PORT": str(self.extra_http_ports[name]),
            "THERMOCLINE_GATEWAY_METRICS_PORT": "0",
            "THERMOCLINE_GATEWAY_AUDIT_DIR": str(self.config.state_dir / f"audit-{name}"),
        }
        self._spawn(name, "gateway", settings | env)
        return self.target(name)

    def _spawn(self, name: str, module: str, env: dict[str, str]) -> None:
        log_file = (self.logs_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", f"services.{module}"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_healthy(name)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to each process, front to back, then SIGKILL to any that outlive the timeout."""
        with _SIGTERM.ignored_while_stopping(self):
            for name in reversed(list(self.processes)):
                process = self.processes[name]
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout_s)
                    except subprocess.TimeoutExpired:
                        log.warning("%s ignored SIGTERM for %.0f s; killing it", name, timeout_s)
                        process.kill()
                        process.wait()
            self.processes.clear()

    def log_tail(self, service: str, num_lines: int = 30) -> str:
        """The last lines a service wrote."""
        path = self.logs_dir / f"{service}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-num_lines:])

    def _service_env(self) -> dict[str, str]:
        config, ports = self.config, self.config.ports
        # The caller's THERMOCLINE_* settings stay out of the services, except where the models live:
        # an engine that looked elsewhere would load another copy, or not know a registered name.
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("THERMOCLINE_") or key in MODEL_LOCATION_SETTINGS
        }
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        for service in SERVICES:
            env[f"THERMOCLINE_{service.upper()}_PORT"] = str(ports.grpc_port(service))
            env[f"THERMOCLINE_{service.upper()}_METRICS_PORT"] = str(ports.metrics[service])
        env |= {
            "THERMOCLINE_ENGINE_MODEL": config.model,
            "THERMOCLINE_GATEWAY_HTTP_PORT": str(ports.gateway_http),
            "THERMOCLINE_GATEWAY_ENGINE_TARGET": self.target("engine"),
            "THERMOCLINE_GATEWAY_ENGINE_TARGETS": ",".join(self.target(n) for n in self.engine_names),
            "THERMOCLINE_GATEWAY_AUDIT_DIR": str(self.audit_dir),
            "THERMOCLINE_GATEWAY_SAFETY_TARGET": self.target("safety"),
            "THERMOCLINE_ENGINE_SAFETY_TARGET": self.target("safety"),
            "THERMOCLINE_ENGINE_KVSTORE_TARGET": self.target("kvstore"),
            "THERMOCLINE_GATEWAY_JWT_KEY_FILE": str(self.public_key_path),
            "THERMOCLINE_GATEWAY_AUDIT_KEY_FILE": str(self.audit_key_path),
            TOKEN_FILE_SETTING: str(self.service_token_path),
            "THERMOCLINE_KVSTORE_DATA_DIR": str(config.state_dir / "kvstore"),
            "REDIS_URL": f"redis://127.0.0.1:{ports.redis}/0",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "PYTHONUNBUFFERED": "1",
        }
        if ENGINE_INTENT_CLASSES.exists():  # a source checkout: the classes compose deploys too
            env["THERMOCLINE_ENGINE_INTENT_CLASSES"] = str(ENGINE_INTENT_CLASSES)
        if config.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = config.otlp_endpoint
        return env | config.env

    def _start_redis(self) -> None:
        if not self.config.start_redis:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            log.warning(
                "redis-server is not installed; rate limits and the kvstore index will be unavailable"
            )
            return
        port = self.config.ports.redis
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        log_file = (self.logs_dir / "redis.log").open("ab")
        self.processes["redis"] = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        self._wait_redis(port)

    def _wait_redis(self, port: int) -> None:
        import redis

        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self._check_alive("redis")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise ServiceFailed(f"redis-server did not answer PING on port {port}:\n{self.log_tail('redis')}")

    def _wait_healthy(self, service: str) -> None:
        """Follows the service's health Watch stream until it says SERVING."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        request = health_pb2.HealthCheckRequest()
        with grpc.insecure_channel(self.target(service)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(service)
                try:
                    for reply in stub.Watch(request, timeout=1.0, wait_for_ready=True):
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.RpcError as error:
                    # CANCELLED: the server went away mid-Watch (a service that refuses its settings
                    # shuts down after its port opened); the next turn's _check_alive says why
                    transient = (
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.CANCELLED,
                    )
                    if error.code() not in transient:
                        raise
        raise ServiceFailed(f"{service} was not healthy after {self.config.startup_timeout_s:.0f} s")

    def _check_alive(self, name: str) -> None:
        code = self.processes[name].poll()
        if code is not None:
            tail = self.log_tail(name)
            if "Address already in use" in tail:
                tail += self._port_report()
            raise ServiceFailed(f"{name} exited with code {code}:\n{tail}")

    def _port_report(self) -> str:
        """Who holds each of the mesh's ports now: for a child that could not bind one, so that the
        failure names what took it (the ports were picked free, see services/common/ports.py)."""
        ports = self.config.ports
        named = {
            **{service: ports.grpc_port(service) for service in (*SERVICES, "redis")},
            "gateway_http": ports.gateway_http,
            **{f"{service} metrics": port for service, port in ports.metrics.items()},
            **self.extra_ports,
            **{f"{name} http": port for name, port in self.extra_http_ports.items()},
        }
        lines = [
            f"  {name} {port}: {', '.join(held)}"
            for name, port in named.items()
            if (held := port_holders(port))
        ]
        return "\nthe mesh's ports held now:\n" + ("\n".join(lines) if lines else "  none")
