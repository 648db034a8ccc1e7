"""Fixtures that start real meshes: real processes, real gRPC, a real redis-server."""

from __future__ import annotations

import os

import torch

# With no GPU, Triton kernels run in its CPU interpreter; it reads this when a kernel is defined,
# so it must be set before anything imports services.engine.attention.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.cli.trace_collector import TraceCollector
from services.engine.model.registry import resolve_model

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


@pytest.fixture(scope="session")
def stories_model() -> Path:
    """The trained stories260K checkpoint from ../shared; the tests that need it skip without it."""
    try:
        return resolve_model("stories260k")
    except (FileNotFoundError, ValueError) as error:
        pytest.skip(f"stories260K is not available: {error}")


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


@pytest.fixture
def gateway_channel(stories_mesh: Mesh) -> Iterator[grpc.Channel]:
    """A channel to the stories mesh's gateway."""
    with grpc.insecure_channel(stories_mesh.target("gateway")) as channel:
        yield channel
