"""Per-tenant rate limits in a real redis-server, shared by two real gateway processes."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import GATEWAY_GENERATE, GATEWAY_TO_SAFETY, TraceCollector
from services.gateway.audit_chain import segment_paths
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import call, refusal, requests_taken, token, token_level, write_policy_files

BURST = 10
TENANTS = {
    "defaults": {"requests_per_s": 1000, "burst_requests": 1000, "tokens_per_min": 1_000_000},
    "tenants": {
        # refills one request every ~17 minutes: within a test, the bucket admits BURST and no more
        "metered": {"requests_per_s": 0.001, "burst_requests": BURST},
        # a bucket of 30 tokens refilled at 1 token/min: within a test it admits 30 tokens and no more;
        # each call costs 5 prompt + 2 completion tokens
        "wordy": {"tokens_per_min": 1, "burst_tokens": 30},
        # the same refill, a bucket of 500: a cancelled stream's charge shows in its level
        "canceller": {"tokens_per_min": 1, "burst_tokens": 500},
        "long-prompts": {"tokens_per_min": 1, "burst_tokens": 100},
        "open-tenant": {"on_redis_down": "open"},
        "closed-tenant": {"on_redis_down": "closed"},
    },
}


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("rate-mesh")
    env = write_policy_files(state / "policy", TENANTS)
    # Leases held longer than any test here takes, so none is given back mid-test on a slow box.
    env["THERMOCLINE_GATEWAY_RATE_LEASE_HOLD_S"] = "60"
    started = start_mesh(stories_model, state, collector, **env)
    started.start_gateway_replica("gateway-2")
    yield started
    started.stop()


def _user(mesh: Mesh, tenant: str) -> str:
    return token(mesh, subject=f"{tenant}-user", tenant=tenant, roles=["user"])


def _attempt(target: str, bearer: str) -> grpc.StatusCode:
    try:
        call(target, bearer, intent="chat", max_tokens=1)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        retry_after = dict(error.trailing_metadata() or ())["retry-after-ms"]
        assert int(retry_after) > 0
        return error.code()
    return grpc.StatusCode.OK


def test_two_gateways_together_admit_no_more_than_the_bucket(mesh: Mesh) -> None:
    bearer = _user(mesh, "metered")
    targets = [mesh.target("gateway"), mesh.target("gateway-2")] * (2 * BURST)
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda target: _attempt(target, bearer), targets))
    admitted = outcomes.count(grpc.StatusCode.OK)
    # Never more than the bucket (and the ~one request it refills during the test). Fewer by at
    # most one per replica: each may hold a request leased for the tenant's next call (and asks for
    # one at a time), which it gives back after THERMOCLINE_GATEWAY_RATE_LEASE_HOLD_S (rate_limiter.py).
    assert BURST - 2 <= admitted <= BURST + 1, f"{admitted} of {len(targets)} admitted; the bucket: {BURST}"
    assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == len(targets) - admitted


def test_a_refusal_says_when_to_retry(mesh: Mesh) -> None:
    bearer = _user(mesh, "metered")
    for _ in range(BURST + 1):  # drained by the test above, or drained here
        error = None
        try:
            call(mesh.target("gateway"), bearer, intent="chat", max_tokens=1)
        except grpc.RpcError as caught:
            error = caught
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit for tenant 'metered' reached" in error.details() and "retry after" in error.details()
    metadata = dict(error.trailing_metadata() or ())
    assert int(metadata["retry-after-ms"]) > 0
    assert metadata["grpc-retry-pushback-ms"] == metadata["retry-after-ms"]


def test_tokens_per_minute_count_prompt_and_completion(mesh: Mesh) -> None:
    bearer = _user(mesh, "wordy")
    for _ in range(4):  # 4 x (5 prompt + 2 completion) = 28 of 30 tokens
        result = call(mesh.target("gateway"), bearer, intent="chat", max_tokens=2)
        assert result.done is not None and result.done.usage.prompt_tokens == 5
    error = refusal(mesh.target("gateway-2"), bearer, intent="chat", max_tokens=2)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 tokens/min in bursts of 30" in error.details()


def test_a_stream_cancelled_by_its_caller_is_charged_the_tokens_it_received(mesh: Mesh) -> None:
    bearer = _user(mesh, "canceller")
    request = build_request(STORIES_PROMPT, max_tokens=400)
    received = 0
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stream = stream_generate(channel, request, call_metadata(bearer, "chat"), 60)
        for message in stream:
            received += len(message.delta.token_ids)
            if received >= 20:  # two of the output screen's windows
                break
        stream.cancel()  # type: ignore[attr-defined]
    # Admission reserved the prompt and all 400 max_tokens; what the stream did not release goes
    # back once the gateway sees the cancel: wait for it, not for a fixed time.
    prompt_tokens, refill = 5, 1  # the bucket refills under one token within the test
    deadline = time.monotonic() + 30
    while (charged := 500 - token_level(mesh, "canceller")) >= prompt_tokens + 400 - refill:
        assert time.monotonic() < deadline, f"{charged:.0f} tokens still charged after receiving {received}"
    assert charged >= prompt_tokens + received - refill  # the tokens released stay charged


def test_a_prompt_over_the_request_budget_gets_both_counts(mesh: Mesh) -> None:
    bearer = _user(mesh, "wordy")
    error = refusal(mesh.target("gateway"), bearer, intent="chat", prompt="Once upon a time " * 10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt of 42 tokens" in error.details() and "token bucket of 30 tokens" in error.details()


def test_a_long_prompt_over_its_budget_is_refused_before_the_safety_screen(
    mesh: Mesh, collector: TraceCollector
) -> None:
    """A long prompt's screen costs safety hundreds of ms of CPU: it starts only once the prompt's
    token count has passed the tenant's budget and bucket."""
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    long_prompt = "Once upon a time " * 300  # 5,100 characters, some 1,200 tokens: over a bucket of 100
    error = refusal(
        mesh.target("gateway"),
        _user(mesh, "long-prompts"),
        intent="chat",
        prompt=long_prompt,
        extra_metadata=[("traceparent", traceparent)],
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "token bucket of 100" in error.details()
    # The gateway exports spans in the order they end: once a later call's spans are in, the
    # refused call's are too.
    later = call(mesh.target("gateway"), _user(mesh, "long-prompts"), intent="chat", max_tokens=1)
    assert later.done is not None
    collector.wait_for_spans(later.done.trace_id, {GATEWAY_GENERATE, GATEWAY_TO_SAFETY}, 60)
    names = {(s.service, s.name) for s in collector.spans(trace_id)}
    assert GATEWAY_GENERATE in names, "the refused call's trace did not arrive"
    assert GATEWAY_TO_SAFETY not in names, "the refused long prompt was sent to the safety service"


def test_the_request_bucket_is_taken_before_the_screen_or_leased_by_the_call_before(
    mesh: Mesh, collector: TraceCollector
) -> None:
    """A tenant's first call takes its request from the bucket before the screen starts; its
    token charge, sent after the screen, leases a request, so the tenant's next call on the same
    gateway makes no Redis call before its screen."""
    bearer = _user(mesh, "lease-tenant")
    root_and_redis = []
    for _ in range(2):
        result = call(mesh.target("gateway"), bearer, intent="chat", max_tokens=1)
        assert result.done is not None
        spans = collector.wait_for_spans(result.done.trace_id, {GATEWAY_GENERATE, GATEWAY_TO_SAFETY}, 60)
        (root,) = [s for s in spans if (s.service, s.name) == GATEWAY_GENERATE]
        (screen,) = [s for s in spans if (s.service, s.name) == GATEWAY_TO_SAFETY]
        # The bucket scripts in the order the gatekeeper runs them (the completion's charge last).
        scripts = [s for s in spans if s.parent_span_id == root.span_id and s.name == "EVALSHA"]
        root_and_redis.append((screen, sorted(scripts, key=lambda s: s.start_ns)))
    screen, (take_request, take_tokens, *_) = root_and_redis[0]
    assert take_request.end_ns <= screen.start_ns, "the screen started before the request bucket answered"
    assert screen.start_ns <= take_tokens.start_ns, "the token bucket's round trip went ahead of the screen"
    screen, scripts = root_and_redis[1]  # the leased call: every script after the screen's start
    assert scripts and screen.start_ns <= scripts[0].start_ns, "the leased call went to Redis first"


def test_a_grpc_caller_cannot_say_its_request_was_taken(mesh: Mesh) -> None:
    """Only the HTTP front's call context carries a request it took for the call (its
    `request_taken`); metadata saying so is the caller's word, and the call's request is taken."""
    tenant = f"forger-{secrets.token_hex(6)}"
    forged = [(name, "1") for name in ("request-taken", "x-request-taken", "request_taken")]
    with requests_taken(mesh, tenant) as taken:
        result = call(
            mesh.target("gateway"), _user(mesh, tenant), intent="chat", max_tokens=1, extra_metadata=forged
        )
    assert result.done is not None
    assert [n for n in taken if n != 0] == [1]


def test_redis_down_fails_open_or_closed_per_tenant(mesh: Mesh) -> None:
    mesh.processes["redis"].kill()
    mesh.processes["redis"].wait(30)
    open_result = call(mesh.target("gateway"), _user(mesh, "open-tenant"), intent="chat", max_tokens=1)
    assert open_result.done is not None
    closed = refusal(mesh.target("gateway"), _user(mesh, "closed-tenant"), intent="chat", max_tokens=1)
    assert closed.code() == grpc.StatusCode.UNAVAILABLE
    assert "rate limiter is unreachable" in closed.details() and "fails closed" in closed.details()
    events = [
        json.loads(line)
        for path in segment_paths(mesh.audit_dir, "decisions")
        for line in path.read_text().splitlines()
    ]
    opened = [e for e in events if e["tenant"] == "open-tenant"]
    assert opened[-1]["decision"] == "allow" and "fails open" in opened[-1]["details"]["rate_limit"]
    assert [e for e in events if e["tenant"] == "closed-tenant"][-1]["decision"] == "deny"
