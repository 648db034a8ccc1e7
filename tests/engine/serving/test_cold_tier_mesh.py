"""The cold tier in the real mesh: the engine's kvstore calls join the request's trace, and the gateway
passes the caller's `x-retrieval-mode` header on to the engine."""

from __future__ import annotations

import secrets

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import ENGINE_GENERATE, TraceCollector
from services.gateway.tokens import mint_token

KVSTORE_LOOKUP = ("thermocline-kvstore", "/thermocline.kvstore.v1.KVStoreService/Lookup")
KVSTORE_PUT = ("thermocline-kvstore", "/thermocline.kvstore.v1.KVStoreService/PutBlocks")
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "


def _generate(mesh: Mesh, prompt: str, *extra: tuple[str, str]) -> str:
    """One request through the gateway; returns its trace id."""
    token = mint_token(mesh.private_key_path.read_bytes(), subject="cold-tier", tenant="acme")
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        request = build_request(prompt, max_tokens=4)
        result = collect(stream_generate(channel, request, call_metadata(token) + list(extra), timeout_s=120))
    assert result.done is not None
    return result.done.trace_id


def test_the_engines_kvstore_calls_are_spans_of_the_request_trace(
    stories_mesh: Mesh, collector: TraceCollector
) -> None:
    prompt = f"{secrets.token_hex(8)} {STORY * 2}"  # new to every cache: looked up, then stored
    trace_id = _generate(stories_mesh, prompt)
    spans = collector.wait_for_spans(trace_id, {ENGINE_GENERATE, KVSTORE_LOOKUP, KVSTORE_PUT}, timeout_s=30)
    engine = next(s for s in spans if (s.service, s.name) == ENGINE_GENERATE)
    kvstore = [s for s in spans if (s.service, s.name) in (KVSTORE_LOOKUP, KVSTORE_PUT)]
    assert kvstore and all(s.parent_span_id == engine.span_id for s in kvstore)


def test_the_gateway_passes_the_retrieval_mode_header_on(stories_mesh: Mesh) -> None:
    _generate(stories_mesh, STORY, ("x-retrieval-mode", "semantic"))  # a mode the engine knows
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stories_mesh, STORY, ("x-retrieval-mode", "psychic"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-retrieval-mode" in (refused.value.details() or "")
