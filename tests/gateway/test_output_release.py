"""Each output release policy through the real mesh: gateways with strict, growing and trailing
release in front of the open mesh's safety service, whose test-only deny rule matches late in
stories260K's golden continuation ("... she saw a big, red ball.")."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from services.cli.client import build_request, call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import GATEWAY_GENERATE, GATEWAY_TO_ENGINE, TraceCollector
from services.gateway.audit_chain import segment_paths
from services.gateway.output_screen import ENGINE_FINISHED_EVENT
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_GOLDEN_TEXT, STORIES_PROMPT, TEST_DENY_PHRASE, TEST_SAFE_MESSAGE
from tests.gateway.conftest import client_request_id
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc
from thermocline.gateway.v1 import gateway_pb2 as pb

MAX_TOKENS = 40
# policy: (OUTPUT_CHECK_TOKENS, OUTPUT_FIRST_WINDOW_TOKENS)
POLICIES = {"strict": (16, 16), "growing": (16, 2), "trailing": (4, 2)}


@pytest.fixture(scope="module")
def gateways(open_mesh: Mesh) -> Iterator[dict[str, str]]:
    """One gateway process per policy, sharing the open mesh's safety service and engine."""
    targets = {}
    for policy, (window, first) in POLICIES.items():
        targets[policy] = open_mesh.start_gateway_replica(
            f"gateway-{policy}",
            THERMOCLINE_GATEWAY_OUTPUT_RELEASE=policy,
            THERMOCLINE_GATEWAY_OUTPUT_CHECK_TOKENS=str(window),
            THERMOCLINE_GATEWAY_OUTPUT_FIRST_WINDOW_TOKENS=str(first),
        )
    yield targets


@pytest.fixture(scope="module")
def phrase_tokens(open_mesh: Mesh) -> int:
    """How many tokens of the golden continuation it takes, from the engine itself, to complete
    the deny phrase."""
    request = engine_pb2.GenerateRequest(
        prompt=STORIES_PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    )
    text, num_tokens = "", 0
    with open_mesh.channel("engine") as channel:
        for message in engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=120):
            text, num_tokens = text + message.text, num_tokens + len(message.token_ids)
            if TEST_DENY_PHRASE in text:
                return num_tokens
    raise AssertionError(f"the golden continuation no longer holds {TEST_DENY_PHRASE!r}: {text!r}")


def _generate(open_mesh: Mesh, target: str, max_tokens: int = MAX_TOKENS) -> list[pb.GenerateResponse]:
    bearer = mint_token(open_mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    with grpc.insecure_channel(target) as channel:
        request = build_request(STORIES_PROMPT, max_tokens=max_tokens)
        return list(stream_generate(channel, request, call_metadata(bearer), timeout_s=120))


def _released(messages: list[pb.GenerateResponse]) -> tuple[str, list[list[int]]]:
    """The completion text the client got, and the token ids of each delta, safe message aside."""
    deltas = [m.delta for m in messages if m.HasField("delta") and m.delta.token_ids]
    return "".join(d.text for d in deltas), [list(d.token_ids) for d in deltas]


def _assert_blocked(messages: list[pb.GenerateResponse]) -> None:
    assert messages[-1].done.finish_reason == pb.FINISH_REASON_SAFETY
    assert messages[-2].delta.text == TEST_SAFE_MESSAGE and not messages[-2].delta.token_ids


@pytest.mark.parametrize("policy", ["strict", "growing"])
def test_held_policies_release_only_screened_windows_and_growing_releases_sooner(
    open_mesh: Mesh, gateways: dict[str, str], phrase_tokens: int, policy: str
) -> None:
    messages = _generate(open_mesh, gateways[policy])
    _assert_blocked(messages)
    released, deltas = _released(messages)
    window, first = POLICIES[policy]
    assert len(deltas[0]) == first  # the first text waits for `first` tokens, not `window`
    # Screens end at first, 2 first, ... doubling to `window`, then every `window` tokens; the
    # client has everything up to the last screen before the phrase, and nothing after it.
    ends, end = [], first
    while end < MAX_TOKENS:
        ends.append(end)
        end += min(window, end) if policy == "growing" else window
    assert sum(map(len, deltas)) == max(e for e in ends if e < phrase_tokens)
    assert [sum(map(len, deltas[: i + 1])) for i in range(len(deltas))] == [
        e for e in ends if e < phrase_tokens
    ]
    assert STORIES_GOLDEN_TEXT.startswith(STORIES_PROMPT + released) and TEST_DENY_PHRASE not in released


def test_trailing_cuts_the_stream_within_one_window_of_the_blocked_text(
    open_mesh: Mesh, gateways: dict[str, str], phrase_tokens: int
) -> None:
    messages = _generate(open_mesh, gateways["trailing"])
    _assert_blocked(messages)
    released, deltas = _released(messages)
    window, _ = POLICIES["trailing"]
    # The last screen that passed ended before the phrase was complete, and the released text
    # runs at most `window` tokens past it.
    assert sum(map(len, deltas)) <= phrase_tokens - 1 + window
    assert STORIES_GOLDEN_TEXT.startswith(STORIES_PROMPT + released)


def test_trailing_finishes_a_clean_completion_with_all_of_its_text(
    open_mesh: Mesh, gateways: dict[str, str], phrase_tokens: int
) -> None:
    num_tokens = phrase_tokens - 1
    messages = _generate(open_mesh, gateways["trailing"], max_tokens=num_tokens)
    assert messages[-1].done.finish_reason == pb.FINISH_REASON_LENGTH
    released, deltas = _released(messages)
    assert sum(map(len, deltas)) == num_tokens and len(deltas[0]) <= POLICIES["trailing"][0]
    assert STORIES_GOLDEN_TEXT.startswith(STORIES_PROMPT + released)


def test_trailing_screens_the_prompt_alongside_prefill_and_sends_nothing_of_a_blocked_one(
    open_mesh: Mesh, gateways: dict[str, str]
) -> None:
    bearer = mint_token(open_mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
    metadata = [*call_metadata(bearer), ("x-request-id", "trailing-blocked-prompt")]
    with grpc.insecure_channel(gateways["trailing"]) as channel:
        request = build_request(f"{STORIES_PROMPT} there was a big, {TEST_DENY_PHRASE}.", max_tokens=8)
        messages = list(stream_generate(channel, request, metadata, timeout_s=120))
    assert len(messages) == 2 and not messages[0].delta.token_ids
    _assert_blocked(messages)
    audit = open_mesh.config.state_dir / "audit-gateway-trailing"
    lines = [line for path in segment_paths(audit, "decisions") for line in path.read_text().splitlines()]
    events = [e for e in map(json.loads, lines) if client_request_id(e) == "trailing-blocked-prompt"]
    assert [(e["decision"], e["reason"].split(" (")[0]) for e in events] == [
        ("allow", "all checks passed"),
        ("deny", "safety: prompt blocked"),
    ]


def test_trailing_ends_the_engine_calls_span_whether_the_stream_finished_or_was_blocked(
    open_mesh: Mesh, gateways: dict[str, str], phrase_tokens: int, collector: TraceCollector
) -> None:
    # After the engine's last message the gateway reads the stream's end in the background, and a
    # block cancels the call: either way the gateway's client span of the call ends (an open span
    # is never exported), under the request's span.
    clean = _generate(open_mesh, gateways["trailing"], max_tokens=phrase_tokens - 1)
    assert clean[-1].done.finish_reason == pb.FINISH_REASON_LENGTH
    blocked = _generate(open_mesh, gateways["trailing"])
    _assert_blocked(blocked)
    calls = {}
    for name, messages in (("clean", clean), ("blocked", blocked)):
        spans = collector.wait_for_spans(
            messages[-1].done.trace_id, {GATEWAY_GENERATE, GATEWAY_TO_ENGINE}, timeout_s=30
        )
        (gateway,) = [s for s in spans if (s.service, s.name) == GATEWAY_GENERATE]
        (to_engine,) = [s for s in spans if (s.service, s.name) == GATEWAY_TO_ENGINE]
        assert to_engine.parent_span_id == gateway.span_id, name
        assert to_engine.attributes["rpc.method"] == "Generate", name
        calls[name] = (gateway, to_engine)
    gateway, to_engine = calls["clean"]
    assert to_engine.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    # The call's span ends when its status arrives, which may be before or after the gateway has
    # handled the last message (the event): only its place inside the request is fixed.
    assert to_engine.start_ns < gateway.events[ENGINE_FINISHED_EVENT] <= gateway.end_ns
