"""The HTTP front's own checks against the real gateway: the token is verified before the body
is read, the body has a deadline, a client that leaves mid-body is a quiet 499, and a call the
front refuses before the servicer sees it is in the audit log, in the gatekeeper's form, by the
time the caller has the answer."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest

from tests.gateway.conftest import requests_taken
from tests.http.conftest import STRICT_TIMEOUT_S, HttpGateway

COMPLETION = {"model": "", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0.0}
VALID = json.dumps(COMPLETION).encode()


def fresh_request_id() -> str:
    """An X-Request-Id no other call of the run has used."""
    return f"intake-{uuid.uuid4().hex}"


@pytest.mark.parametrize(
    ("body", "headers", "says"),
    [
        (b"{not json", {}, "not valid JSON"),
        (json.dumps(COMPLETION | {"max_token": 3}).encode(), {}, "unknown field 'max_token'"),
        (json.dumps(COMPLETION | {"prompt": "\ud800"}).encode(), {}, "surrogate"),
        (VALID, {"X-Timeout-S": "nan"}, "X-Timeout-S"),
        (VALID, {"X-Retrieval-Mode": "m" * 300}, "X-Retrieval-Mode"),
    ],
    ids=["not-json", "unknown-field", "surrogate", "timeout-header", "retrieval-mode-header"],
)
def test_a_refusal_before_the_servicer_is_audited(
    http_gateway: HttpGateway, body: bytes, headers: dict[str, str], says: str
) -> None:
    request_id = fresh_request_id()
    answer = http_gateway.post("/completions", body, headers | {"X-Request-Id": request_id})
    assert answer.status == 400 and says in answer.error["message"]
    events = http_gateway.audit_events(request_id)
    assert [(e["action"], e["resource"], e["decision"], e["reason"]) for e in events] == [
        ("invoke", "model:?", "deny", answer.error["message"])
    ]
    assert events[0]["details"] == {"client_request_id": request_id, "front": "http"}
    assert events[0]["trace_id"]
    assert (events[0]["actor_principal"], events[0]["tenant"]) == ("tester", "acme")  # the token came first


def test_a_token_issued_in_the_future_is_refused_naming_iat(http_gateway: HttpGateway) -> None:
    # the gateway allows 30 s of clock skew; the token's nbf is now
    bearer = http_gateway.token(iat=int(time.time()) + 600)
    answer = http_gateway.post("/completions", VALID, {"Authorization": f"Bearer {bearer}"})
    assert answer.status == 401
    assert "issued in the future (iat" in answer.error["message"] and "nbf" not in answer.error["message"]


def test_a_models_refusal_before_the_servicer_is_audited(http_gateway: HttpGateway) -> None:
    request_id = fresh_request_id()
    answer = http_gateway.call("GET", "/models", headers={"X-Timeout-S": "0", "X-Request-Id": request_id})
    assert answer.status == 400
    events = http_gateway.audit_events(request_id)
    assert [(e["action"], e["resource"], e["decision"]) for e in events] == [
        ("list_models", "model:*", "deny")
    ]


def test_a_call_the_servicer_refuses_is_audited_once(http_gateway: HttpGateway) -> None:
    request_id = fresh_request_id()
    answer = http_gateway.post(
        "/completions", VALID, {"X-Request-Id": request_id, "X-Intent": "no-such-intent"}
    )
    assert answer.status == 400 and "unknown intent" in answer.error["message"]
    events = http_gateway.audit_events(request_id)
    assert [(e["decision"], e["actor_principal"]) for e in events] == [("deny", "tester")]
    assert "front" not in events[0]["details"]


@pytest.mark.parametrize("header", ["X-Intent", "X-Retrieval-Mode", "X-Request-Id"])
def test_a_header_the_gateway_reads_sent_twice_is_refused(http_gateway: HttpGateway, header: str) -> None:
    values = {"X-Intent": ("chat", "batch"), "X-Retrieval-Mode": ("off", "semantic")}.get(header, ("a", "b"))
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {http_gateway.user_token}"]
    lines += [f"Content-Length: {len(VALID)}", "Connection: close"]
    lines += [f"{header}: {value}" for value in values] + (["X-Intent: chat"] if header != "X-Intent" else [])
    exchange = http_gateway.exchange("\r\n".join([*lines, "", ""]).encode() + VALID)
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"], exchange.received
    assert f"2 '{header.lower()}' metadata entries sent; send it once".encode() in exchange.received


def test_the_answer_names_the_gateways_request_id_and_the_audit_keeps_the_callers(
    http_gateway: HttpGateway,
) -> None:
    client_id = fresh_request_id()
    answer = http_gateway.post("/completions", VALID, {"X-Request-Id": client_id})
    assert answer.status == 200, answer.body
    own_id = answer.headers["x-request-id"]
    assert own_id != client_id and answer.body["id"] == f"cmpl-{own_id}"
    events = http_gateway.audit_events(client_id)
    assert [(e["request_id"], e["decision"]) for e in events] == [(own_id, "allow")]


def head(
    request_id: str, content_length: int, authorization: str = "", path: str = "/v1/completions"
) -> bytes:
    """A request head declaring a body; no Authorization header when `authorization` is empty."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", "X-Intent: chat", f"X-Request-Id: {request_id}"]
    lines += [f"Content-Length: {content_length}"] + (
        [f"Authorization: {authorization}"] if authorization else []
    )
    return "\r\n".join([*lines, "", ""]).encode()


BODY_START = b'{"prompt": "'


@pytest.mark.parametrize("authorization", ["", "Bearer not-a-jwt"], ids=["no-token", "bad-token"])
def test_a_body_without_a_valid_token_is_refused_before_it_is_read(
    http_gateway: HttpGateway, authorization: str
) -> None:
    request_id = fresh_request_id()
    exchange = http_gateway.exchange(head(request_id, 600_000, authorization) + BODY_START)
    assert exchange.status_lines == ["HTTP/1.1 401 Unauthorized"] and exchange.is_closed, exchange.received
    events = http_gateway.audit_events(request_id)
    assert [(e["decision"], e["actor_principal"], e["details"]) for e in events] == [
        ("deny", "unauthenticated", {"client_request_id": request_id, "front": "http"})
    ]


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(http_gateway: HttpGateway) -> None:
    request_id = fresh_request_id()
    bearer = f"Bearer {http_gateway.user_token}"
    exchange = http_gateway.exchange(head(request_id, 10**7, bearer) + BODY_START)
    assert exchange.status_lines == ["HTTP/1.1 400 Bad Request"] and exchange.is_closed, exchange.received
    assert b"request body exceeds" in exchange.received
    assert [e["decision"] for e in http_gateway.audit_events(request_id)] == ["deny"]


def test_a_body_that_comes_too_slowly_is_a_408_and_closes_the_connection(strict_gateway: HttpGateway) -> None:
    request_id = fresh_request_id()
    bearer = f"Bearer {strict_gateway.user_token}"
    exchange = strict_gateway.exchange(head(request_id, 1000, bearer) + BODY_START)
    assert exchange.status_lines == ["HTTP/1.1 408 Request Timeout"] and exchange.is_closed, exchange.received
    events = strict_gateway.audit_events(request_id)
    assert [(e["decision"], e["actor_principal"]) for e in events] == [("deny", "tester")]
    assert f"did not arrive within {STRICT_TIMEOUT_S:g} s" in events[0]["reason"]


def test_a_client_that_leaves_mid_body_is_a_quiet_499(strict_gateway: HttpGateway) -> None:
    request_id = fresh_request_id()
    num_before, log_before = strict_gateway.num_handled("/v1/completions", 499), len(strict_gateway.log())
    with socket.create_connection(strict_gateway.address) as connection:
        connection.sendall(head(request_id, 1000, f"Bearer {strict_gateway.user_token}") + BODY_START)
    deadline = time.monotonic() + 30
    while strict_gateway.num_handled("/v1/completions", 499) == num_before:
        assert time.monotonic() < deadline, "the hang-up was never counted as 499"
    assert "Traceback" not in strict_gateway.log()[log_before:]
    assert strict_gateway.audit_events(request_id) == []  # no answer, so no decision


def test_a_body_refusal_takes_a_request_from_the_tenants_bucket(http_gateway: HttpGateway) -> None:
    # a verified caller's bad bodies cost it its rate, as every refusal after the token does on gRPC
    headers = {"Authorization": f"Bearer {http_gateway.token(tenant='tight-bodies', roles=['user'])}"}
    unknown_field = json.dumps(COMPLETION | {"max_token": 3}).encode()
    first = http_gateway.post("/completions", unknown_field, headers)
    assert first.status == 400 and "unknown field" in first.error["message"], first.body
    request_id = fresh_request_id()
    second = http_gateway.post("/completions", unknown_field, headers | {"X-Request-Id": request_id})
    assert second.status == 429, second.body
    assert "rate limit for tenant 'tight-bodies'" in second.error["message"]
    assert int(second.headers["retry-after"]) > 0 and int(second.headers["retry-after-ms"]) > 0
    events = http_gateway.audit_events(request_id)
    assert [(e["decision"], e["tenant"], e["details"]) for e in events] == [
        ("deny", "tight-bodies", {"client_request_id": request_id, "front": "http"})
    ]


def test_a_call_that_passes_the_front_is_charged_one_request(http_gateway: HttpGateway) -> None:
    # the tenant's bucket holds one request: a call charged by the front and again by the
    # servicer would be refused
    headers = {"Authorization": f"Bearer {http_gateway.token(tenant='tight-once', roles=['user'])}"}
    answer = http_gateway.post("/completions", VALID, headers)
    assert answer.status == 200, answer.body
    assert http_gateway.post("/completions", VALID, headers).status == 429


def test_the_front_takes_a_passing_calls_request_in_its_one_redis_call(http_gateway: HttpGateway) -> None:
    # the front's take is the call's own: no give-back and no second take by the gatekeeper (each a
    # Redis round trip, and a give-back refused while the token bucket is in debt loses a request)
    tenant = f"front-{uuid.uuid4().hex[:12]}"
    headers = {"Authorization": f"Bearer {http_gateway.token(tenant=tenant, roles=['user'])}"}
    with requests_taken(http_gateway.mesh, tenant) as taken:
        answer = http_gateway.post("/completions", VALID, headers)
    assert answer.status == 200, answer.body
    assert [n for n in taken if n != 0] == [1]


def test_a_prompt_over_the_limit_costs_the_request_the_front_took(http_gateway: HttpGateway) -> None:
    # the body fits its envelope, the prompt does not: the gatekeeper refuses it after the token,
    # the caller having paid, so the refusal names it and the next call finds the bucket empty
    headers = {"Authorization": f"Bearer {http_gateway.token(tenant='tight-prompt', roles=['user'])}"}
    request_id = fresh_request_id()
    too_long = json.dumps(COMPLETION | {"prompt": "a" * (512 * 1024 + 1)}).encode()
    answer = http_gateway.post("/completions", too_long, headers | {"X-Request-Id": request_id})
    assert answer.status == 400 and "this gateway accepts at most" in answer.error["message"], answer.body
    events = http_gateway.audit_events(request_id)
    assert [(e["decision"], e["tenant"]) for e in events] == [("deny", "tight-prompt")]
    assert http_gateway.post("/completions", VALID, headers).status == 429
