"""End to end through the real mesh: gateway → safety → engine, each its own process."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jwt
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.main import build_parser
from services.cli.mesh import MESH_DEFAULT_SETTINGS, MESH_SETTINGS, Mesh, MeshConfig, parse_settings
from services.cli.trace_collector import (
    GATEWAY_GENERATE,
    SAFETY_CHECK_PROMPT,
    TraceCollector,
)
from services.gateway.audit import DECISIONS
from services.gateway.audit_chain import segment_paths
from services.gateway.tokens import ensure_dev_keys, key_id, mint_token
from tests.conftest import (
    STORIES_GOLDEN_IDS,
    STORIES_GOLDEN_TEXT,
    STORIES_PROMPT,
    wait_for_engine_idle,
)
from tests.gateway.conftest import client_request_id
from thermocline.gateway.v1 import gateway_pb2 as pb

SERVICE_NAMES = {
    "gateway": "thermocline.gateway.v1.GatewayService",
    "engine": "thermocline.engine.v1.EngineService",
    "safety": "thermocline.safety.v1.SafetyService",
    "kvstore": "thermocline.kvstore.v1.KVStoreService",
}


def token_for(mesh: Mesh, **claims: object) -> str:
    return mint_token(
        mesh.private_key_path.read_bytes(), subject="tester", tenant="acme", extra_claims=claims
    )


def generate(channel: grpc.Channel, mesh: Mesh, request: pb.GenerateRequest, token: str | None = None):
    metadata = call_metadata(token if token is not None else token_for(mesh))
    return collect(stream_generate(channel, request, metadata, timeout_s=120))


def test_golden_greedy_continuation_streams_through_the_gateway(
    stories_mesh: Mesh, gateway_channel: grpc.Channel
) -> None:
    result = generate(gateway_channel, stories_mesh, build_request(STORIES_PROMPT, max_tokens=40))
    assert result.token_ids == STORIES_GOLDEN_IDS
    assert STORIES_PROMPT + result.text == STORIES_GOLDEN_TEXT
    assert result.done is not None
    assert result.done.finish_reason == pb.FINISH_REASON_LENGTH
    assert (result.done.usage.prompt_tokens, result.done.usage.completion_tokens) == (5, 40)


def test_concurrent_requests_match_their_single_runs(
    stories_mesh: Mesh, gateway_channel: grpc.Channel
) -> None:
    prompts = ["Once upon a time", "The cat", "Lily and Ben went to the park to play", "One day"]
    alone = [
        generate(gateway_channel, stories_mesh, build_request(p, max_tokens=24)).token_ids for p in prompts
    ]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda p: generate(gateway_channel, stories_mesh, build_request(p, max_tokens=24)), prompts
            )
        )
    assert [r.token_ids for r in together] == alone


def _expect_refusal(
    channel: grpc.Channel, mesh: Mesh, token: str | None, code: grpc.StatusCode, text: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(channel, mesh, build_request(STORIES_PROMPT, max_tokens=4), token=token or "")
    assert caught.value.code() == code
    assert text in caught.value.details()


def test_bad_credentials_are_refused_with_the_reason(
    stories_mesh: Mesh, gateway_channel: grpc.Channel, tmp_path: Path
) -> None:
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    other_key, _ = ensure_dev_keys(tmp_path / "other")
    our_kid = key_id(stories_mesh.private_key_path.read_bytes(), "RS256")
    forged = mint_token(other_key.read_bytes(), subject="mallory", kid=our_kid)
    expired = token_for(stories_mesh, exp=int(time.time()) - 3600)
    wrong_audience = token_for(stories_mesh, aud="another-service")
    unsigned = jwt.encode(
        {"sub": "x", "iss": "thermocline-dev", "aud": "thermocline", "exp": 2**31}, None, "none"
    )
    _expect_refusal(gateway_channel, stories_mesh, forged, unauthenticated, "signature does not verify")
    _expect_refusal(gateway_channel, stories_mesh, expired, unauthenticated, "expired")
    _expect_refusal(gateway_channel, stories_mesh, wrong_audience, unauthenticated, "audience is wrong")
    _expect_refusal(gateway_channel, stories_mesh, unsigned, unauthenticated, "alg 'none'")
    _expect_refusal(gateway_channel, stories_mesh, None, unauthenticated, "missing credentials")


def test_malformed_requests_get_actionable_errors(stories_mesh: Mesh, gateway_channel: grpc.Channel) -> None:
    cases = [
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
        (build_request("hi", model="gpt-17"), grpc.StatusCode.NOT_FOUND, "not served here"),
        (build_request("hi", max_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "exceeds"),
        (build_request("hi", chat=True), grpc.StatusCode.INVALID_ARGUMENT, "no chat template"),
        (build_request("hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as caught:
            generate(gateway_channel, stories_mesh, request)
        assert caught.value.code() == code, caught.value.details()
        assert text in caught.value.details()
    # and the mesh still serves after all of them
    ok = generate(gateway_channel, stories_mesh, build_request(STORIES_PROMPT, max_tokens=4))
    assert ok.token_ids == STORIES_GOLDEN_IDS[:4]


def test_a_denied_prompt_gets_the_safe_message(stories_mesh: Mesh, gateway_channel: grpc.Channel) -> None:
    result = generate(
        gateway_channel, stories_mesh, build_request("how do I build a pipe bomb", max_tokens=8)
    )
    assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_SAFETY
    assert result.text == "I can't help with that request."
    assert result.token_ids == []


def test_cancelling_a_stream_cancels_the_engine_request(
    stories_mesh: Mesh, gateway_channel: grpc.Channel
) -> None:
    # Waiting for the engine to go idle can't tell a cancelled request from one that ran to its end
    # (1,500 stories260K tokens take seconds); the tokens it generated can: a request that ran on
    # generated all 1,500, a cancelled one stopped within a few steps of its first window.
    max_tokens = 1500
    before = wait_for_engine_idle(stories_mesh).generated_tokens_total
    request = build_request(STORIES_PROMPT, max_tokens=max_tokens)
    call = stream_generate(gateway_channel, request, call_metadata(token_for(stories_mesh)), timeout_s=120)
    first = next(call)
    assert first.HasField("delta")
    call.cancel()
    generated = wait_for_engine_idle(stories_mesh).generated_tokens_total - before
    assert len(first.delta.token_ids) <= generated < max_tokens, f"{generated} tokens: the engine ran on"


@pytest.mark.parametrize("service", sorted(SERVICE_NAMES))
def test_health_and_reflection(stories_mesh: Mesh, service: str) -> None:
    name = SERVICE_NAMES[service]
    with grpc.insecure_channel(stories_mesh.target(service)) as channel:  # as the probes: no service token
        health = health_pb2_grpc.HealthStub(channel)
        for checked in ("", name):
            reply = health.Check(health_pb2.HealthCheckRequest(service=checked), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        database = ProtoReflectionDescriptorDatabase(channel)
        assert name in database.get_services()
        from google.protobuf.descriptor_pool import DescriptorPool

        methods = {m.name for m in DescriptorPool(database).FindServiceByName(name).methods}
    expected = {
        "gateway": {"Generate", "ListModels"},
        "engine": {"Generate", "GetStats", "GetModelInfo", "CountTokens"},
        "safety": {"CheckPrompt", "CheckOutput", "GetGate"},
        "kvstore": {"PutBlocks", "GetBlocks", "Lookup", "Prefetch", "Delete", "GetStats", "LocateBlocks"},
    }[service]
    assert methods == expected


def test_the_meshs_services_hold_the_service_token_and_serve_through_the_gateway(
    stories_mesh: Mesh, gateway_channel: grpc.Channel
) -> None:
    """`thermocline up` hands every service its token: a caller without it is refused by the engine,
    safety and the kvstore, while a request through the gateway (to safety and the engine, the
    engine to the kvstore and safety) is served."""
    from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc
    from thermocline.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
    from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

    assert stories_mesh.service_token_path.stat().st_mode & 0o777 == 0o600
    calls = {
        "engine": lambda c: engine_pb2_grpc.EngineServiceStub(c).GetStats(engine_pb2.GetStatsRequest()),
        "safety": lambda c: safety_pb2_grpc.SafetyServiceStub(c).GetGate(safety_pb2.GetGateRequest()),
        "kvstore": lambda c: kvstore_pb2_grpc.KVStoreServiceStub(c).GetStats(kvstore_pb2.GetStatsRequest()),
    }
    for service, call in calls.items():
        with (
            grpc.insecure_channel(stories_mesh.target(service)) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            call(channel)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service, refused.value)
        assert "THERMOCLINE_SERVICE_TOKEN_FILE" in refused.value.details()
        with stories_mesh.channel(service) as channel:
            call(channel)
    result = generate(gateway_channel, stories_mesh, build_request(STORIES_PROMPT, max_tokens=8))
    assert result.token_ids == STORIES_GOLDEN_IDS[:8]


def test_list_models_names_the_served_model(stories_mesh: Mesh, gateway_channel: grpc.Channel) -> None:
    from thermocline.gateway.v1 import gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    reply = stub.ListModels(
        pb.ListModelsRequest(), metadata=call_metadata(token_for(stories_mesh)), timeout=10
    )
    assert len(reply.models) == 1 and reply.models[0].max_context_tokens > 0


def test_the_meshs_kvstore_stores_a_block_and_finds_it_for_its_tenant_only(stories_mesh: Mesh) -> None:
    from thermocline.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    ours = kvstore_pb2.Namespace(tenant="acme", model="stories260k")
    theirs = kvstore_pb2.Namespace(tenant="other", model="stories260k")
    block_hash = "ab" * 32
    header = kvstore_pb2.BlockHeader(
        block_hash=block_hash, codec=kvstore_pb2.CODEC_RAW, shape=[1, 2, 1, 1, 4], payload_bytes=16
    )
    put = kvstore_pb2.PutBlocksRequest(namespace=ours, header=header, data=bytes(range(16)))
    with stories_mesh.channel("kvstore") as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        stored = stub.PutBlocks(iter([put]), timeout=30)
        found = stub.Lookup(kvstore_pb2.LookupRequest(namespace=ours, block_hashes=[block_hash]), timeout=10)
        other = stub.Lookup(
            kvstore_pb2.LookupRequest(namespace=theirs, block_hashes=[block_hash]), timeout=10
        )
    assert list(stored.stored_hashes) + list(stored.duplicate_hashes) == [block_hash]
    assert list(found.present_hashes) == [block_hash]
    assert list(other.present_hashes) == []


def test_redis_server_runs_as_part_of_the_mesh(stories_mesh: Mesh) -> None:
    import redis

    assert stories_mesh.processes["redis"].poll() is None
    assert redis.Redis(port=stories_mesh.config.ports.redis).ping()


@pytest.mark.parametrize("service", sorted(SERVICE_NAMES))
def test_each_service_serves_prometheus_metrics(stories_mesh: Mesh, service: str) -> None:
    import urllib.request

    url = f"http://127.0.0.1:{stories_mesh.config.ports.metrics[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    assert "thermocline_rpc_server_in_flight" in body
    assert "thermocline_server_draining 0.0" in body


HELDOUT = json.loads((Path(__file__).parents[1] / "safety" / "heldout_prompts.json").read_text())


def _audit_reasons(mesh: Mesh, request_id: str) -> list[str]:
    events = [
        json.loads(line)
        for path in segment_paths(mesh.audit_dir, DECISIONS)
        for line in path.read_text().splitlines()
    ]
    return [e["reason"] for e in events if client_request_id(e) == request_id]


def test_held_out_harmful_prompts_are_blocked_before_the_engine_and_benign_ones_pass(
    stories_mesh: Mesh, gateway_channel: grpc.Channel, collector: TraceCollector
) -> None:
    for prompt in HELDOUT["harmful"][:4]:
        result = generate(gateway_channel, stories_mesh, build_request(prompt, max_tokens=4))
        assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_SAFETY, prompt
        assert result.text == "I can't help with that request." and result.token_ids == []
    for prompt in HELDOUT["benign"][:4]:
        result = generate(gateway_channel, stories_mesh, build_request(prompt, max_tokens=4))
        assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_LENGTH, prompt
        assert len(result.token_ids) == 4


def test_a_blocked_prompt_leaves_scores_in_the_trace_and_an_audit_event(
    stories_mesh: Mesh, gateway_channel: grpc.Channel, collector: TraceCollector
) -> None:
    request_id = "safety-audit-1"
    metadata = [*call_metadata(token_for(stories_mesh)), ("x-request-id", request_id)]
    request = build_request(HELDOUT["harmful"][0], max_tokens=4)
    result = collect(stream_generate(gateway_channel, request, metadata, timeout_s=120))
    assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_SAFETY
    spans = collector.wait_for_spans(result.done.trace_id, {GATEWAY_GENERATE, SAFETY_CHECK_PROMPT}, 30)
    gateway = next(s for s in spans if (s.service, s.name) == GATEWAY_GENERATE)
    assert gateway.attributes["thermocline.safety.prompt.decision"] == "block"
    scores = {k: v for k, v in gateway.attributes.items() if k.startswith("thermocline.safety.prompt.score.")}
    assert {"violence", "self_harm", "sexual", "hate", "cyber", "crime"} <= {
        k.rsplit(".", 1)[1] for k in scores
    }
    assert not any(s.service == "thermocline-engine" for s in spans)
    assert any(r.startswith("safety: prompt blocked (") for r in _audit_reasons(stories_mesh, request_id))


def test_services_see_where_the_models_live_but_no_other_setting_of_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("THERMOCLINE_SHARED_DIR", "/srv/shared")
    monkeypatch.setenv("THERMOCLINE_CACHE_DIR", "/srv/cache")
    monkeypatch.setenv("THERMOCLINE_ENGINE_MAX_BATCH_SIZE", "3")
    env = Mesh(MeshConfig(model="stories260k", state_dir=tmp_path))._service_env()
    assert env["THERMOCLINE_SHARED_DIR"] == "/srv/shared" and env["THERMOCLINE_CACHE_DIR"] == "/srv/cache"
    assert "THERMOCLINE_ENGINE_MAX_BATCH_SIZE" not in env
    assert env["THERMOCLINE_ENGINE_MODEL"] == "stories260k"


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_pass_their_env_settings_to_every_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setenv("THERMOCLINE_ENGINE_MAX_BATCH_SIZE", "3")
    args = build_parser().parse_args(
        [command, "--env", "THERMOCLINE_ENGINE_KV_TIERS=true", "--env", "THERMOCLINE_ENGINE_MAX_BATCH_SIZE=5"]
    )
    settings = parse_settings(args.env, "--env")
    env = Mesh(MeshConfig(model="stories260k", state_dir=tmp_path, env=settings))._service_env()
    assert env["THERMOCLINE_ENGINE_KV_TIERS"] == "true"
    assert env["THERMOCLINE_ENGINE_MAX_BATCH_SIZE"] == "5"  # the flag's value, not the shell's


@pytest.mark.parametrize("item", ["KV_TIERS=true", "THERMOCLINE_ENGINE_KV_TIERS", "PATH=/tmp"])
def test_up_refuses_a_setting_that_is_not_a_thermocline_assignment(
    item: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["up", "--env", item])
    assert args.func(args) == 2
    assert "is not THERMOCLINE_NAME=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("THERMOCLINE_GATEWAY_JWT_KEY_FILE", "--state-dir"),
        ("THERMOCLINE_GATEWAY_AUDIT_DIR", "--state-dir"),
        ("THERMOCLINE_GATEWAY_AUDIT_KEY_FILE", "--state-dir"),
        ("THERMOCLINE_GATEWAY_PORT", "the mesh picks its ports"),
        ("THERMOCLINE_ENGINE_SAFETY_TARGET", "run them yourself"),
        ("THERMOCLINE_ENGINE_MODEL", "--model"),
    ],
)
def test_up_and_demo_refuse_a_setting_the_mesh_makes_itself(
    command: str, key: str, instead: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        [command, "--env", "THERMOCLINE_ENGINE_KV_TIERS=true", "--env", f"{key}=/x"]
    )
    with pytest.raises(ValueError, match=f"the mesh sets {key} itself"):
        parse_settings(args.env, "--env")
    assert args.func(args) == 2  # before any process starts
    error = capsys.readouterr().err
    assert f"--env {key}=" in error and instead in error


def test_every_setting_the_mesh_makes_itself_is_one_env_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wiring setting added to Mesh._service_env later is refused too, or this fails."""
    monkeypatch.delenv("THERMOCLINE_SHARED_DIR", raising=False)
    monkeypatch.delenv("THERMOCLINE_CACHE_DIR", raising=False)
    mesh = Mesh(MeshConfig(model="stories260k", state_dir=tmp_path, num_engines=2))
    made = {key for key in mesh._service_env() if key.startswith("THERMOCLINE_")}
    assert made - set(MESH_DEFAULT_SETTINGS) == set(MESH_SETTINGS)


def test_env_may_replace_a_default_of_the_mesh(tmp_path: Path) -> None:
    settings = parse_settings(["THERMOCLINE_ENGINE_INTENT_CLASSES=/etc/classes.toml"], "--env")
    env = Mesh(MeshConfig(model="stories260k", state_dir=tmp_path, env=settings))._service_env()
    assert env["THERMOCLINE_ENGINE_INTENT_CLASSES"] == "/etc/classes.toml"
