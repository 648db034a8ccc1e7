"""Fixtures that start real meshes: real processes, real gRPC, a real redis-server."""

from __future__ import annotations

import os

import torch

# With no GPU, Triton kernels run in its CPU interpreter; it reads this when a kernel is defined,
# so it must be set before anything imports services.engine.attention.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (`make test` runs tests/engine's in-process tests in several) share the
# machine's cores: each takes its share for torch's intra-op threads, where each would otherwise take
# them all and the workers' threads would fight over every core.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.cli.trace_collector import TraceCollector
from services.common.service_auth import TOKEN_FILE_SETTING
from services.engine.model.registry import model_dirs, resolve_model
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

STORIES_DIR = model_dirs().shared_dir / "models" / "stories260K"  # trained tiny Llama: HF and GGUF

# Golden greedy continuation of "Once upon a time" (with BOS) from stories260K's SOURCE.md.
STORIES_PROMPT = "Once upon a time"
STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_GOLDEN_IDS = [
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
    411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
]  # fmt: skip
STORIES_GOLDEN_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


# Under CI a skip for a missing prerequisite is a failure: a checkout without ../shared must not pass
# green with a quarter of the suite skipped. Skip reasons that name one of these fail under CI=true.
REQUIRED_UNDER_CI = ("stories260K", "docker-compose")


def is_ci() -> bool:
    """Whether this run is CI's (CI=true), where every prerequisite must be present."""
    return os.environ.get("CI") == "true"


def skip_unless_ci(reason: str) -> NoReturn:
    """Skips the test, or fails it under CI, where a missing prerequisite is a broken machine."""
    if is_ci():
        pytest.fail(f"{reason}; CI (CI=true) must run these tests", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI, a skip whose reason names a required prerequisite becomes a failure.

    This covers fixtures outside this file (tests/engine/conftest.py skips without stories260K).
    """
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not (is_ci() and report.skipped and call.excinfo is not None):
        return
    reason = str(call.excinfo.value)
    if any(name in reason for name in REQUIRED_UNDER_CI) and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where it must run: {reason}"


@pytest.fixture(scope="session")
def stories_model() -> Path:
    """The trained stories260K checkpoint from ../shared; without it the tests skip (fail under CI)."""
    try:
        return resolve_model("stories260k")
    except (FileNotFoundError, ValueError) as error:
        skip_unless_ci(f"stories260K is not available: {error}")


@pytest.fixture(scope="session")
def stories_hf_dir() -> Path:
    """stories260K in HF format (skips when the shared folder is absent)."""
    path = STORIES_DIR / "hf"
    if not (path / "config.json").exists():
        pytest.skip(f"stories260K not found at {path}")
    return path


@pytest.fixture(scope="session")
def stories_gguf() -> Path:
    """stories260K as llama.cpp wrote it (skips when the shared folder is absent)."""
    path = STORIES_DIR / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"stories260K GGUF not found at {path}")
    return path


@pytest.fixture(scope="session")
def collector() -> Iterator[TraceCollector]:
    """An OTLP receiver that every test mesh exports its spans to."""
    receiver = TraceCollector().start()
    yield receiver
    receiver.stop()


def start_mesh(model: Path | str, state_dir: Path, collector: TraceCollector, **env: str) -> Mesh:
    """A started mesh on free ports, exporting traces to `collector`."""
    config = MeshConfig(
        model=str(model),
        state_dir=state_dir,
        ports=Ports.free(),
        otlp_endpoint=collector.endpoint,
        env=dict(env),
        startup_timeout_s=300,
    )
    return Mesh(config).__enter__()


@pytest.fixture(scope="session")
def stories_mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """The whole mesh serving stories260K, shared by the end-to-end tests."""
    mesh = start_mesh(stories_model, tmp_path_factory.mktemp("stories-mesh"), collector)
    yield mesh
    mesh.stop()


@contextlib.contextmanager
def holding_service_token(token_file: Path) -> Iterator[None]:
    """This process calls the services as one of them: with THERMOCLINE_SERVICE_TOKEN_FILE set, the
    clients it builds in process (Router, ColdTier, KVStoreClient) carry the token, as a service's do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOKEN_FILE_SETTING, str(token_file))
        yield


def engine_stats(mesh: Mesh, engine: str = "engine") -> engine_pb2.GetStatsResponse:
    """The engine's GetStats: its queue now and the tokens it has generated in its lifetime."""
    with mesh.channel(engine) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=10)


def wait_for_engine_idle(
    mesh: Mesh, timeout_s: float = 60, engine: str = "engine"
) -> engine_pb2.GetStatsResponse:
    """Waits until the engine runs and queues nothing; returns its stats then."""
    deadline = time.monotonic() + timeout_s
    while (stats := engine_stats(mesh, engine)).num_running + stats.num_waiting:
        assert time.monotonic() < deadline, f"the engine still holds requests after {timeout_s} s: {stats}"
    return stats


def rpcs_handled(metrics_url: str, method: str, code: str | None = None) -> float:
    """thermocline_rpc_server_handled_total for one full method name (/pkg.Service/Method), summed
    over status codes, or for one code ("OK", "UNAVAILABLE", ...), from a process's /metrics URL."""
    with urllib.request.urlopen(metrics_url, timeout=30) as page:
        families = text_string_to_metric_families(page.read().decode())
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == "thermocline_rpc_server_handled_total"
        and sample.labels.get("method") == method
        and (code is None or sample.labels.get("code") == code)
    )


# A deny rule that only the test meshes carry: stories260K's golden continuation of STORIES_PROMPT
# reaches it in its third 16-token output window ("... she saw a big, red ball.").
TEST_DENY_PHRASE = "red ball"
TEST_SAFE_MESSAGE = "[withheld by the output screen]"
# No limit for the open mesh's tenants: a call refused by the rate limiter never reaches validation.
UNLIMITED_TENANTS = {
    "defaults": {"requests_per_s": 1e6, "burst_requests": 10**6, "tokens_per_min": 10**12, "max_streams": 0}
}


@pytest.fixture(scope="session")
def open_mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """A stories260K mesh with tenant limits lifted and the test-only deny rule, for fuzzing and the
    output screen (so that neither spends the shared mesh's rate-limit budget)."""
    state_dir = tmp_path_factory.mktemp("open-mesh")
    tenants, patterns = state_dir / "tenants.json", state_dir / "deny_patterns.txt"
    tenants.write_text(json.dumps(UNLIMITED_TENANTS))
    patterns.write_text(f"test-only: \\b{TEST_DENY_PHRASE}\\b\n")
    mesh = start_mesh(
        stories_model,
        state_dir,
        collector,
        THERMOCLINE_GATEWAY_TENANTS_FILE=str(tenants),
        THERMOCLINE_SAFETY_DENY_PATTERNS=str(patterns),
        THERMOCLINE_SAFETY_SAFE_MESSAGE=TEST_SAFE_MESSAGE,
        THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS="16",
    )
    yield mesh
    mesh.stop()


@pytest.fixture
def gateway_channel(stories_mesh: Mesh) -> Iterator[grpc.Channel]:
    """A channel to the stories mesh's gateway."""
    with grpc.insecure_channel(stories_mesh.target("gateway")) as channel:
        yield channel
