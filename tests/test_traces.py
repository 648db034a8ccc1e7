"""One request through the real mesh is one trace: every hop's span, linked parent to child, with
the GenAI attributes, the engine's queue/prefill/decode spans, Redis spans, and the sampled flag
of the caller's traceparent honoured."""

from __future__ import annotations

import secrets

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import (
    ENGINE_GENERATE,
    GATEWAY_GENERATE,
    GATEWAY_TO_ENGINE,
    GATEWAY_TO_SAFETY,
    REQUEST_PATH,
    SAFETY_CHECK_PROMPT,
    CollectedSpan,
    TraceCollector,
)
from services.gateway.output_screen import ENGINE_FINISHED_EVENT, FIRST_TEXT_ARRIVED_EVENT
from services.gateway.servicer import FIRST_TEXT_EVENT
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_PROMPT, STORIES_PROMPT_IDS

GATEWAY_TO_SAFETY_OUTPUT = ("thermocline-gateway", "/thermocline.safety.v1.SafetyService/CheckOutput")
GATEWAY_COUNT = ("thermocline-gateway", "/thermocline.engine.v1.EngineService/CountTokens")
ENGINE_QUEUE = ("thermocline-engine", "engine.queue_wait")
ENGINE_PREFILL = ("thermocline-engine", "engine.prefill")
ENGINE_DECODE = ("thermocline-engine", "engine.decode")
FULL_PATH = REQUEST_PATH | {ENGINE_QUEUE, ENGINE_PREFILL, ENGINE_DECODE}
GEN_AI_REQUEST = ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.request.max_tokens")
GEN_AI_RESPONSE = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
)
MAX_TOKENS = 6


def _traceparent(trace_id: str, is_sampled: bool) -> tuple[str, str]:
    return ("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if is_sampled else '00'}")


def _generate(
    mesh: Mesh,
    traceparent: tuple[str, str] | None = None,
    prompt: str = STORIES_PROMPT,
    request_id: str | None = None,
) -> str:
    """Runs one request through the gateway; returns the trace id the gateway reports."""
    token = mint_token(mesh.private_key_path.read_bytes(), subject="tracer", tenant="acme")
    metadata = call_metadata(token) + ([traceparent] if traceparent else [])
    metadata += [("x-request-id", request_id)] if request_id else []
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        request = build_request(prompt, max_tokens=MAX_TOKENS)
        result = collect(stream_generate(channel, request, metadata, timeout_s=120))
    assert result.done is not None
    return result.done.trace_id


def _one(spans: list[CollectedSpan], key: tuple[str, str]) -> CollectedSpan:
    found = [s for s in spans if (s.service, s.name) == key]
    assert len(found) == 1, f"{key}: {len(found)} spans"
    return found[0]


def test_one_request_is_one_trace_with_every_hop_linked(
    stories_mesh: Mesh, collector: TraceCollector
) -> None:
    trace_id = _generate(stories_mesh, request_id="traced-request")
    assert len(trace_id) == 32
    spans = collector.wait_for_spans(trace_id, FULL_PATH, timeout_s=30)
    assert {s.trace_id for s in spans} == {trace_id}
    gateway = _one(spans, GATEWAY_GENERATE)
    assert gateway.parent_span_id == ""
    for client, server in [(GATEWAY_TO_SAFETY, SAFETY_CHECK_PROMPT), (GATEWAY_TO_ENGINE, ENGINE_GENERATE)]:
        assert _one(spans, client).parent_span_id == gateway.span_id, client
        assert _one(spans, server).parent_span_id == _one(spans, client).span_id, server
    engine = _one(spans, ENGINE_GENERATE)
    assert engine.attributes["gen_ai.usage.input_tokens"] == len(STORIES_PROMPT_IDS)
    # the audit's request id (the gateway's own) on both hops: an audit event leads to its trace;
    # the caller's x-request-id is on the gateway's span beside it
    assert gateway.attributes["thermocline.request_id"] == engine.attributes["thermocline.request_id"]
    assert gateway.attributes["thermocline.request_id"] != "traced-request"
    assert gateway.attributes["thermocline.client_request_id"] == "traced-request"
    for span in (gateway, engine):
        for key in GEN_AI_REQUEST + GEN_AI_RESPONSE:
            assert span.attributes.get(key) not in (None, "", []), (span.service, key)
        assert span.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert span.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert span.attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert _one(spans, SAFETY_CHECK_PROMPT).attributes["thermocline.safety.decision"] == "allow"
    # when the gateway handled the engine's last message: after the engine call started, inside
    # the request. The call's span ends when its status arrives, which may come before or after
    # that, and after the request's span (the done message does not wait for it).
    to_engine = _one(spans, GATEWAY_TO_ENGINE)
    finished_ns = gateway.events[ENGINE_FINISHED_EVENT]
    assert gateway.start_ns < to_engine.start_ns < finished_ns <= gateway.end_ns


def test_the_first_text_is_traced_after_what_it_waited_for(
    stories_mesh: Mesh, collector: TraceCollector
) -> None:
    # Under strict (this mesh's release policy) the first text of a 6-token answer waits for the
    # engine's last message and the output screen of the whole answer. The arrival event carries
    # the time that message reached the gateway, which bench/gateway_spans.py subtracts, not the
    # engine call's span end, which may come after the text went out.
    trace_id = _generate(stories_mesh)
    spans = collector.wait_for_spans(trace_id, REQUEST_PATH | {GATEWAY_TO_SAFETY_OUTPUT}, timeout_s=30)
    gateway, to_engine = _one(spans, GATEWAY_GENERATE), _one(spans, GATEWAY_TO_ENGINE)
    output_check = _one(spans, GATEWAY_TO_SAFETY_OUTPUT)
    arrived_ns, first_text_ns = gateway.events[FIRST_TEXT_ARRIVED_EVENT], gateway.events[FIRST_TEXT_EVENT]
    assert to_engine.start_ns < arrived_ns <= gateway.events[ENGINE_FINISHED_EVENT]
    assert arrived_ns <= output_check.start_ns < output_check.end_ns <= first_text_ns < gateway.end_ns


def test_engine_spans_nest_under_its_rpc_in_time_order(stories_mesh: Mesh, collector: TraceCollector) -> None:
    trace_id = _generate(stories_mesh)
    spans = collector.wait_for_spans(trace_id, FULL_PATH, timeout_s=30)
    engine = _one(spans, ENGINE_GENERATE)
    queue, decode = _one(spans, ENGINE_QUEUE), _one(spans, ENGINE_DECODE)
    prefills = [s for s in spans if (s.service, s.name) == ENGINE_PREFILL]
    for child in (queue, decode, *prefills):
        assert child.parent_span_id == engine.span_id, child.name
        assert engine.start_ns <= child.start_ns <= child.end_ns <= engine.end_ns, child.name
    assert queue.end_ns <= min(p.start_ns for p in prefills)
    assert max(p.end_ns for p in prefills) <= decode.start_ns
    assert (
        sum(p.attributes["thermocline.prefill.tokens"] for p in prefills)
        == engine.attributes["gen_ai.usage.input_tokens"]
    )


def test_redis_commands_are_spans_in_the_request_trace(stories_mesh: Mesh, collector: TraceCollector) -> None:
    trace_id = _generate(stories_mesh)
    spans = collector.wait_for_spans(trace_id, FULL_PATH, timeout_s=30)
    ids = {s.span_id for s in spans}
    redis = [
        s for s in spans if "redis" in (s.attributes.get("db.system"), s.attributes.get("db.system.name"))
    ]
    assert redis, f"no Redis span among {[(s.service, s.name) for s in spans]}"
    assert all(s.service == "thermocline-gateway" and s.parent_span_id in ids for s in redis)


def test_the_callers_sampled_flag_is_honoured(stories_mesh: Mesh, collector: TraceCollector) -> None:
    unsampled_id, sampled_id = secrets.token_hex(16), secrets.token_hex(16)
    assert _generate(stories_mesh, _traceparent(unsampled_id, is_sampled=False)) == unsampled_id
    assert _generate(stories_mesh, _traceparent(sampled_id, is_sampled=True)) == sampled_id
    # Each process exports its spans in the order they end, so once every hop's spans of the later
    # sampled request have arrived, any span of the earlier unsampled one would have too.
    spans = collector.wait_for_spans(sampled_id, FULL_PATH, timeout_s=30)
    assert _one(spans, GATEWAY_GENERATE).parent_span_id != ""  # continues the caller's span
    assert collector.spans(unsampled_id) == []


def test_the_prompt_screen_runs_beside_the_rest_of_admission(
    stories_mesh: Mesh, collector: TraceCollector
) -> None:
    # a prompt the gateway has not counted before, so its count is a round trip to the engine
    trace_id = _generate(stories_mesh, prompt=f"{STORIES_PROMPT} {secrets.token_hex(4)}")
    spans = collector.wait_for_spans(trace_id, FULL_PATH | {GATEWAY_COUNT}, timeout_s=30)
    count, screen = _one(spans, GATEWAY_COUNT), _one(spans, GATEWAY_TO_SAFETY)
    assert screen.start_ns < count.end_ns, "the prompt screen waited for the token count"


def test_health_checks_and_reflection_make_no_spans(stories_mesh: Mesh, collector: TraceCollector) -> None:
    with grpc.insecure_channel(stories_mesh.target("gateway")) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert ProtoReflectionDescriptorDatabase(channel).get_services()
    # The gateway exports its spans in the order they end: once this request's have arrived, so
    # have any the health check and the reflection call made.
    collector.wait_for_spans(_generate(stories_mesh), REQUEST_PATH, 30)
    names = {name for _, name in collector.span_names()}
    assert not [n for n in names if n.startswith(("/grpc.health.", "/grpc.reflection."))]
    assert GATEWAY_GENERATE[1] in names
