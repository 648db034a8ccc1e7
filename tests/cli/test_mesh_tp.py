"""The engine service started with THERMOCLINE_ENGINE_TP=2 launches its own second rank and serves
the golden stories260K continuation through the real mesh."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.trace_collector import TraceCollector
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT, start_mesh


def test_an_engine_set_to_tp2_serves_the_golden_continuation(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> None:
    state_dir = tmp_path_factory.mktemp("tp2-mesh")
    mesh = start_mesh(stories_model, state_dir, collector, THERMOCLINE_ENGINE_TP="2")
    try:
        token = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            result = collect(
                stream_generate(
                    channel, build_request(STORIES_PROMPT, max_tokens=40), call_metadata(token), timeout_s=120
                )
            )
        assert result.token_ids == STORIES_GOLDEN_IDS
        assert "tp=2" in mesh.log_tail("engine", num_lines=200)
    finally:
        mesh.stop()
