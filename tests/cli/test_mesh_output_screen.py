"""The output screen through the real mesh: a window the safety service blocks never reaches the
client, the windows before it do, and the safe message ends the stream with a SAFETY finish.

The open mesh's safety service carries one test-only deny rule that matches late in stories260K's
golden continuation of "Once upon a time" ("... she saw a big, red ball."), so the prompt passes and
the first windows are clean.
"""

from __future__ import annotations

import grpc

from services.cli.client import build_request, call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_GOLDEN_TEXT, STORIES_PROMPT, TEST_DENY_PHRASE, TEST_SAFE_MESSAGE
from thermocline.gateway.v1 import gateway_pb2 as pb

CHECK_TOKENS = 16  # the open mesh's THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS


def test_a_blocked_output_window_never_reaches_the_client_and_the_safe_message_ends_the_stream(
    open_mesh: Mesh,
) -> None:
    bearer = mint_token(open_mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    with grpc.insecure_channel(open_mesh.target("gateway")) as channel:
        request = build_request(STORIES_PROMPT, max_tokens=40)
        messages = list(stream_generate(channel, request, call_metadata(bearer), timeout_s=120))
    deltas = [m.delta for m in messages if m.HasField("delta")]
    assert messages[-1].HasField("done") and messages[-1].done.finish_reason == pb.FINISH_REASON_SAFETY
    assert deltas[-1].text == TEST_SAFE_MESSAGE and not deltas[-1].token_ids
    released = "".join(d.text for d in deltas[:-1])
    released_ids = [i for d in deltas[:-1] for i in d.token_ids]
    # Whole windows before the blocked one reached the client, unchanged ...
    assert released_ids and len(released_ids) % CHECK_TOKENS == 0
    assert STORIES_GOLDEN_TEXT.startswith(STORIES_PROMPT + released)
    # ... and the window holding the phrase did not, nor anything after it.
    assert TEST_DENY_PHRASE in STORIES_GOLDEN_TEXT and TEST_DENY_PHRASE not in released
    assert len(released_ids) < 40
