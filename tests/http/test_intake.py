"""The HTTP front's own checks against the real gateway: a call it refuses before the servicer
sees it is in the audit log, in the gatekeeper's form, by the time the caller has the answer."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.http.conftest import HttpGateway

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
    assert events[0]["details"] == {"front": "http"} and events[0]["trace_id"]


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
