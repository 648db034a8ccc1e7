"""A request the engine fails reaches the client as an error with the engine's reason, on gRPC and
on the HTTP front, never as a finish: a mesh on stories260K whose head overflows at the lowest
temperature (tests/engine/overflow_stories.py), a real numerical fault in the engine process."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.engine.overflow_stories import FAULTING_TEMPERATURE, make_overflow_stories
from tests.gateway.conftest import token

FAULT_TEXT = "numerical fault in sampling"


@pytest.fixture(scope="module")
def mesh(
    stories_hf_dir: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    model = make_overflow_stories(stories_hf_dir, tmp_path_factory.mktemp("overflow") / "model")
    started = start_mesh(model, tmp_path_factory.mktemp("engine-failures-mesh"), collector)
    yield started
    started.stop()


def _generate(mesh: Mesh, temperature: float) -> None:
    request = build_request(STORIES_PROMPT, max_tokens=8, temperature=temperature)
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        collect(stream_generate(channel, request, call_metadata(token(mesh)), 60))


def test_grpc_gets_unavailable_with_the_engines_reason(mesh: Mesh) -> None:
    _generate(mesh, 0.0)  # served
    with pytest.raises(grpc.RpcError) as raised:
        _generate(mesh, FAULTING_TEMPERATURE)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    assert FAULT_TEXT in raised.value.details() and "retry" in raised.value.details()


def _post_completion(mesh: Mesh, is_stream: bool) -> tuple[int, bytes]:
    url = urlsplit(mesh.http_url())
    assert url.hostname is not None
    body = {"model": "", "prompt": STORIES_PROMPT, "max_tokens": 8, "temperature": FAULTING_TEMPERATURE}
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        headers = {"Authorization": f"Bearer {token(mesh)}", "Content-Type": "application/json"}
        connection.request(
            "POST", f"{url.path}/completions", json.dumps(body | {"stream": is_stream}), headers
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "stream"])
def test_http_answers_an_error_not_a_stop(mesh: Mesh, is_stream: bool) -> None:
    # the fault comes at the first token, before any text was released: no stream has started
    status, body = _post_completion(mesh, is_stream)
    assert status == 503, body
    assert FAULT_TEXT in json.loads(body)["error"]["message"]
