"""The output screen through the real mesh: a window the safety service blocks never reaches the
client, the windows before it do, and the safe message ends the stream with a SAFETY finish.

The mesh's safety service gets one extra deny rule that matches late in stories260K's golden
continuation of "Once upon a time" ("... she saw a big, red ball."), so the prompt passes and the
first windows are clean.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_GOLDEN_TEXT, STORIES_PROMPT, start_mesh
from thermocline.gateway.v1 import gateway_pb2 as pb

BLOCKED_PHRASE = "red ball"
SAFE_MESSAGE = "[withheld by the output screen]"
CHECK_TOKENS = 16


@pytest.fixture(scope="module")
def screening_mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """A stories260K mesh whose safety service denies BLOCKED_PHRASE."""
    state_dir = tmp_path_factory.mktemp("screening-mesh")
    patterns = state_dir / "deny_patterns.txt"
    patterns.write_text(f"test-only: \\b{BLOCKED_PHRASE}\\b\n")
    mesh = start_mesh(
        stories_model,
        state_dir,
        collector,
        THERMOCLINE_SAFETY_DENY_PATTERNS=str(patterns),
        THERMOCLINE_SAFETY_SAFE_MESSAGE=SAFE_MESSAGE,
        THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS=str(CHECK_TOKENS),
    )
    yield mesh
    mesh.stop()


def test_a_blocked_output_window_never_reaches_the_client_and_the_safe_message_ends_the_stream(
    screening_mesh: Mesh,
) -> None:
    bearer = mint_token(screening_mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    with grpc.insecure_channel(screening_mesh.target("gateway")) as channel:
        request = build_request(STORIES_PROMPT, max_tokens=40)
        messages = list(stream_generate(channel, request, call_metadata(bearer), timeout_s=120))
    deltas = [m.delta for m in messages if m.HasField("delta")]
    assert messages[-1].HasField("done") and messages[-1].done.finish_reason == pb.FINISH_REASON_SAFETY
    assert deltas[-1].text == SAFE_MESSAGE and not deltas[-1].token_ids
    released = "".join(d.text for d in deltas[:-1])
    released_ids = [i for d in deltas[:-1] for i in d.token_ids]
    # Whole windows before the blocked one reached the client, unchanged ...
    assert released_ids and len(released_ids) % CHECK_TOKENS == 0
    assert STORIES_GOLDEN_TEXT.startswith(STORIES_PROMPT + released)
    # ... and the window holding the phrase did not, nor anything after it.
    assert BLOCKED_PHRASE in STORIES_GOLDEN_TEXT and BLOCKED_PHRASE not in released
    assert len(released_ids) < 40
