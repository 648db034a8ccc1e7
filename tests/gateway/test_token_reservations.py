"""Token reservations through a real gateway and a real redis-server: a call takes its prompt plus
max_tokens from its tenant's token bucket at admission, and gives back what it did not use when it
ends, whichever way it ends.

A burst is sent while the engine is stopped (SIGSTOP): an admitted call then holds its reservation
until the engine resumes, however fast or slow the machine is, and a call that does not fit is
refused at once. The gateway's prompt count and model info are cached by a first call, so
admission itself needs no engine.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import grpc
import pytest

from services.cli.client import call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from tests.conftest import STORIES_PROMPT, TEST_DENY_PHRASE, start_mesh
from tests.gateway.conftest import call, refusal, stopped, token, token_level, write_policy_files
from thermocline.gateway.v1 import gateway_pb2 as pb

BUCKET = 300  # the reviewer's 300 tokens/min, refilled at one token a minute: nothing refills in a test
MAX_TOKENS = 190
PROMPT_TOKENS = 5  # STORIES_PROMPT with BOS
BURST = 4  # one reservation of 195 fits the bucket, two do not
TENANTS = {
    "defaults": {
        "requests_per_s": 1000,
        "burst_requests": 1000,
        "tokens_per_min": 1,
        "burst_tokens": BUCKET,
        "max_request_tokens": 200,
    },
    "tenants": {"warm": {"tokens_per_min": 1_000_000}, "big-requests": {"max_request_tokens": 1000}},
}


class Outcome(NamedTuple):
    """One call of a burst: admitted with its completion's tokens, or refused with its message."""

    is_admitted: bool
    message: str = ""
    num_completion_tokens: int = 0


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("reservation-mesh")
    env = write_policy_files(state / "policy", TENANTS)
    patterns = state / "deny_patterns.txt"
    patterns.write_text(f"test-only: \\b{TEST_DENY_PHRASE}\\b\n")
    started = start_mesh(
        stories_model, state, collector, THERMOCLINE_SAFETY_DENY_PATTERNS=str(patterns), **env
    )
    # Caches the prompt's count and the model's info in the gateway, so admission needs no engine.
    assert call(started.target("gateway"), _user(started, "warm"), intent="chat", max_tokens=1).done
    yield started
    started.stop()


def _user(mesh: Mesh, tenant: str) -> str:
    return token(mesh, subject=f"{tenant}-user", tenant=tenant, roles=["user"])


def _fresh_tenant(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


def _num_allowed(mesh: Mesh, tenant: str) -> int:
    """The tenant's admitted calls so far, from the audit log (written before any answer)."""
    events = [json.loads(line) for path in segment_paths(mesh.audit_dir, "decisions") for line in path.open()]
    return sum(e["tenant"] == tenant and e["decision"] == "allow" for e in events)


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"


def _burst(mesh: Mesh, tenant: str, attempt: Callable[[], Outcome]) -> list[Outcome]:
    """BURST concurrent calls while the engine is stopped: each is admitted (and waits for the
    engine) or refused; the engine resumes once every one is decided."""
    with ThreadPoolExecutor(BURST) as pool:
        with stopped(mesh.processes["engine"]):
            calls = [pool.submit(attempt) for _ in range(BURST)]

            def num_decided() -> int:
                return sum(_is_refused(c) for c in calls) + _num_allowed(mesh, tenant)

            _wait_until(lambda: num_decided() >= BURST, f"all {BURST} calls were admitted or refused")
        return [c.result() for c in calls]


def _is_refused(future: Future[Outcome]) -> bool:
    return future.done() and not future.result().is_admitted


def _grpc_attempt(mesh: Mesh, bearer: str) -> Outcome:
    try:
        result = call(mesh.target("gateway"), bearer, intent="chat", max_tokens=MAX_TOKENS)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert int(dict(error.trailing_metadata() or ())["retry-after-ms"]) > 0
        return Outcome(False, error.details() or "")
    assert result.done is not None
    return Outcome(True, num_completion_tokens=result.done.usage.completion_tokens)


def _http_attempt(mesh: Mesh, bearer: str) -> Outcome:
    url = urlsplit(mesh.http_url())
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
    body = {"prompt": STORIES_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Authorization": f"Bearer {bearer}", "X-Intent": "chat", "Content-Type": "application/json"}
    try:
        connection.request("POST", f"{url.path}/completions", json.dumps(body), headers)
        reply = connection.getresponse()
        answer = json.loads(reply.read())
    finally:
        connection.close()
    if reply.status == 429:
        assert int(reply.getheader("Retry-After") or 0) > 0
        return Outcome(False, answer["error"]["message"])
    assert reply.status == 200, answer
    return Outcome(True, num_completion_tokens=answer["usage"]["completion_tokens"])


def _check_burst(mesh: Mesh, tenant: str, outcomes: list[Outcome]) -> None:
    admitted = [o for o in outcomes if o.is_admitted]
    num_completion_tokens = sum(o.num_completion_tokens for o in admitted)
    assert len(admitted) == 1, (
        f"{len(admitted)} of {BURST} calls reserving {PROMPT_TOKENS} + {MAX_TOKENS} tokens were admitted "
        f"to a bucket of {BUCKET}; they generated {num_completion_tokens} tokens"
    )
    for refused in (o for o in outcomes if not o.is_admitted):
        assert f"token budget of tenant {tenant!r} reached" in refused.message
        # 105 tokens left once the one call reserved 195: its prompt and 100 more fit now
        assert "set max_tokens to at most 100 to run now, or retry after" in refused.message
    spent = BUCKET - token_level(mesh, tenant)  # the admitted call's done message came after its charge
    assert spent == pytest.approx(PROMPT_TOKENS + num_completion_tokens, abs=1)
    assert spent <= BUCKET


def test_a_burst_of_grpc_calls_is_admitted_only_as_far_as_its_reservations_fit(mesh: Mesh) -> None:
    tenant = _fresh_tenant("burst-grpc")
    bearer = _user(mesh, tenant)
    _check_burst(mesh, tenant, _burst(mesh, tenant, lambda: _grpc_attempt(mesh, bearer)))


def test_a_burst_over_http_is_admitted_only_as_far_as_its_reservations_fit(mesh: Mesh) -> None:
    tenant = _fresh_tenant("burst-http")
    bearer = _user(mesh, tenant)
    _check_burst(mesh, tenant, _burst(mesh, tenant, lambda: _http_attempt(mesh, bearer)))


def test_a_call_that_ends_early_gives_back_what_it_did_not_use_and_the_next_fits(mesh: Mesh) -> None:
    tenant = _fresh_tenant("early-stop")
    bearer = _user(mesh, tenant)
    request = pb.GenerateRequest(
        prompt=STORIES_PROMPT, sampling=pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, stop=["."])
    )
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        first = collect(stream_generate(channel, request, call_metadata(bearer, "chat"), 60))
    assert first.done is not None and first.done.finish_reason == pb.FINISH_REASON_STOP
    used = first.done.usage.completion_tokens
    assert used < MAX_TOKENS - 100, f"the first sentence took {used} tokens"
    assert BUCKET - token_level(mesh, tenant) == pytest.approx(PROMPT_TOKENS + used, abs=1)
    # Without the give-back, 105 tokens would be left: too few for a second reservation of 195.
    assert call(mesh.target("gateway"), bearer, intent="chat", max_tokens=MAX_TOKENS).done is not None


def test_a_prompt_blocked_by_safety_gives_its_whole_max_tokens_back(mesh: Mesh) -> None:
    tenant = _fresh_tenant("blocked")
    prompt = f"Once upon a time there was a {TEST_DENY_PHRASE}"
    result = call(mesh.target("gateway"), _user(mesh, tenant), intent="chat", max_tokens=150, prompt=prompt)
    assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_SAFETY
    assert BUCKET - token_level(mesh, tenant) == pytest.approx(result.done.usage.prompt_tokens, abs=1)


def test_a_call_cancelled_before_its_first_token_gives_its_reservation_back(mesh: Mesh) -> None:
    tenant = _fresh_tenant("cancelled")
    bearer = _user(mesh, tenant)
    request = pb.GenerateRequest(prompt=STORIES_PROMPT, sampling=pb.SamplingOptions(max_tokens=MAX_TOKENS))
    # With the engine stopped, the admitted call waits for it, holding its reservation.
    with grpc.insecure_channel(mesh.target("gateway")) as channel, stopped(mesh.processes["engine"]):
        held = stream_generate(channel, request, call_metadata(bearer, "chat"), 120)
        _wait_until(lambda: _num_allowed(mesh, tenant) == 1, "the first call was admitted")
        error = refusal(mesh.target("gateway"), bearer, intent="chat", max_tokens=MAX_TOKENS)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        held.cancel()  # type: ignore[attr-defined]
        _wait_until(
            lambda: BUCKET - token_level(mesh, tenant) < PROMPT_TOKENS + 1, "the reservation came back"
        )
    assert call(mesh.target("gateway"), bearer, intent="chat", max_tokens=MAX_TOKENS).done is not None


def test_a_max_tokens_that_can_never_fit_the_bucket_is_invalid_and_says_what_would(mesh: Mesh) -> None:
    bearer = _user(mesh, "big-requests")  # may ask for 1000 tokens a request, from a bucket of 300
    error = refusal(mesh.target("gateway"), bearer, intent="chat", max_tokens=BUCKET - PROMPT_TOKENS + 1)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "it can never be admitted: set max_tokens to at most 295" in (error.details() or "")
    assert call(mesh.target("gateway"), bearer, intent="chat", max_tokens=BUCKET - PROMPT_TOKENS).done
