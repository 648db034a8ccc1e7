"""The in-loop safety gate: hash checks and their policies, coverage, and firing inside a batch."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.common.gate_file import (
    ENGINE_HEAD,
    HeadWeights,
    gate_scores,
    load_gate,
    manifest_path_for,
    write_gate,
)
from services.engine.gate.gate_loader import (
    DEFAULT_GATE_FILE,
    Announcement,
    GateConfig,
    GateSource,
    LoadedGate,
    MismatchPolicy,
    ServedModel,
    check_gate,
    open_gate,
)
from services.engine.gate.safety_gate import (
    DEFAULT_SAFE_MESSAGE,
    GatePolicy,
    GateRefused,
    GateStatus,
    InLoopGate,
)
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import FinishReason
from services.engine.serving.engine_metrics import EngineCollector
from services.engine.serving.generation_result import ResultCollector
from services.gateway.tokens import mint_token
from tests.conftest import start_mesh
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc
from thermocline.gateway.v1 import gateway_pb2

CPU = torch.device("cpu")
CATEGORIES = ("violence", "cyber")
SAFE_MESSAGE = "[blocked by the in-loop gate]"
GREEDY_12 = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _write_head(
    path: Path, weight: torch.Tensor, bias: torch.Tensor, model: str, version: str = "t1"
) -> Path:
    """A gate file with only an engine head (`weight` [C + 1, H], `bias` [C + 1]) for `model`."""
    manifest = {
        "version": version,
        "categories": list(CATEGORIES),
        "heads": {
            ENGINE_HEAD: {
                "features": {"model": model, "hidden_size": weight.shape[1], "layer": "final_norm"},
                "thresholds": dict.fromkeys(CATEGORIES, 0.5),
            }
        },
    }
    write_gate(path, {f"{ENGINE_HEAD}.weight": weight, f"{ENGINE_HEAD}.bias": bias}, manifest)
    return path


def _random_gate(path: Path, hidden_size: int, model: str = "tiny", seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(CATEGORIES) + 1, hidden_size, generator=generator)
    return _write_head(path, weight, torch.zeros(len(CATEGORIES) + 1), model)


def _config(path: Path, **overrides: object) -> GateConfig:
    return GateConfig(file=path, safe_message=SAFE_MESSAGE, **overrides)  # type: ignore[arg-type]


def _check(config: GateConfig, model: ServedModel, announced: Announcement | None = None) -> LoadedGate:
    weights = config.file.read_bytes()
    return check_gate(config, manifest_path_for(config.file).read_text(), weights, announced, model, CPU)


def _announce(path: Path) -> Announcement:
    """What safety's GetGate would say for the gate at `path`."""
    manifest = json.loads(manifest_path_for(path).read_text())
    return Announcement(manifest["version"], manifest["sha256"], manifest_path_for(path).read_text(), b"")


def _tamper_manifest_hash(path: Path) -> None:
    manifest_path = manifest_path_for(path)
    manifest = json.loads(manifest_path.read_text())
    manifest["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))


# --- the folded head -----------------------------------------------------------------------------


def test_folded_head_fires_exactly_where_gate_scores_reach_the_thresholds() -> None:
    generator = torch.Generator().manual_seed(1)
    head = HeadWeights(
        weight=torch.randn(4, 32, generator=generator),
        bias=torch.randn(4, generator=generator),
        thresholds=torch.tensor([0.3, 0.6, 0.9]),
    )
    hidden = torch.randn(512, 32, generator=generator)  # [B, H]
    reference = gate_scores(hidden, head)  # [B, C]
    is_clear = (reference - head.thresholds).abs() > 1e-4  # rounding may differ at the boundary
    flags = InLoopGate(head, ("a", "b", "c"), SAFE_MESSAGE, CPU).flags(hidden)
    assert flags[is_clear].tolist() == (reference >= head.thresholds)[is_clear].tolist()
    assert 0 < int(flags.sum()) < flags.numel()  # both outcomes occur


def test_a_threshold_of_one_never_fires() -> None:
    head = HeadWeights(torch.zeros(2, 4), torch.tensor([-50.0, 50.0]), torch.tensor([1.0]))
    assert not InLoopGate(head, ("a",), SAFE_MESSAGE, CPU).flags(torch.randn(3, 4)).any()


# --- start-up checks -----------------------------------------------------------------------------


def test_matching_gate_for_the_model_is_active(tmp_path: Path) -> None:
    path = _random_gate(tmp_path / "gate.safetensors", 64)
    model = ServedModel(("tiny",), 64)
    unverified = _check(_config(path), model)
    assert unverified.report.status is GateStatus.UNVERIFIED and unverified.head is not None
    ok = _check(_config(path, safety_target="127.0.0.1:1"), model, _announce(path))
    assert ok.report.status is GateStatus.OK and ok.report.is_active and not ok.report.is_refusing
    assert ok.report.sha256 == ok.report.announced_sha256


def test_manifest_hash_that_does_not_match_the_file_refuses(tmp_path: Path, tiny_dir: Path) -> None:
    path = _random_gate(tmp_path / "gate.safetensors", 64)
    _tamper_manifest_hash(path)
    loaded = open_gate(_config(path), ServedModel(("tiny",), 64), CPU)
    assert loaded.report.status is GateStatus.MISMATCH and loaded.report.is_refusing
    assert loaded.head is None and "0" * 64 in loaded.report.detail
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    engine.set_safety_gate(*loaded)
    with pytest.raises(GateRefused) as refused:
        engine.submit([5, 6, 7], GREEDY_12, lambda event: None)
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "THERMOCLINE_ENGINE_GATE_MISMATCH=warn" in refused.value.message


def test_manifest_hash_mismatch_under_warn_serves_ungated(tmp_path: Path, tiny_dir: Path) -> None:
    path = _random_gate(tmp_path / "gate.safetensors", 64)
    _tamper_manifest_hash(path)
    loaded = open_gate(_config(path, mismatch=MismatchPolicy.WARN), ServedModel(("tiny",), 64), CPU)
    assert loaded.report.status is GateStatus.MISMATCH
    assert not loaded.report.is_refusing and not loaded.report.is_active and loaded.head is None
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    engine.set_safety_gate(*loaded)
    result = engine.generate([[5, 6, 7]], GREEDY_12)[0]
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 12


def test_announced_hash_that_differs_refuses_or_warns_with_the_local_gate(tmp_path: Path) -> None:
    local = _random_gate(tmp_path / "local.safetensors", 64, seed=0)
    other = _random_gate(tmp_path / "other.safetensors", 64, seed=1)
    model = ServedModel(("tiny",), 64)
    refused = _check(_config(local, safety_target="127.0.0.1:1"), model, _announce(other))
    assert refused.report.status is GateStatus.MISMATCH and refused.report.is_refusing
    assert refused.report.announced_sha256 == _announce(other).sha256 != refused.report.sha256
    warn = _config(local, safety_target="127.0.0.1:1", mismatch=MismatchPolicy.WARN)
    warned = _check(warn, model, _announce(other))
    assert warned.report.status is GateStatus.MISMATCH and warned.head is not None
    assert warned.report.is_active and not warned.report.is_refusing


def test_same_weights_under_another_manifest_version_is_a_mismatch(tmp_path: Path) -> None:
    """The hash covers the weights only, so a manifest (thresholds) change shows in the version."""
    path = _random_gate(tmp_path / "gate.safetensors", 64)
    announced = _announce(path)._replace(version="a-later-version")
    checked = _check(_config(path, safety_target="127.0.0.1:1"), ServedModel(("tiny",), 64), announced)
    assert checked.report.status is GateStatus.MISMATCH and checked.report.is_refusing
    assert "a-later-version" in checked.report.detail and "manifests (thresholds)" in checked.report.detail


@pytest.mark.parametrize("model", [ServedModel(("tiny",), 48), ServedModel(("other-model",), 64)])
def test_gate_for_another_model_leaves_this_one_ungated(tmp_path: Path, model: ServedModel) -> None:
    path = _random_gate(tmp_path / "gate.safetensors", 64)
    loaded = _check(_config(path), model)
    assert loaded.report.status is GateStatus.UNCOVERED and loaded.head is None
    assert not loaded.report.is_refusing


def test_gate_source_off_is_absent(tmp_path: Path) -> None:
    loaded = open_gate(GateConfig(source=GateSource.OFF), ServedModel(("tiny",), 64), CPU)
    assert loaded.report.status is GateStatus.ABSENT and loaded.head is None


def test_shipped_gate_covers_smollm2_and_not_a_tiny_model() -> None:
    smollm2 = open_gate(GateConfig(), ServedModel(("smollm2-135m-instruct",), 576), CPU)
    assert smollm2.report.status is GateStatus.UNVERIFIED and smollm2.head is not None
    assert smollm2.head.num_categories == 6
    tiny = open_gate(GateConfig(), ServedModel(("tiny",), 64), CPU)
    assert tiny.report.status is GateStatus.UNCOVERED


# --- firing inside a batch -----------------------------------------------------------------------


def _final_states(path: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' final normed hidden state at every position `[S, H]`: the known states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([token_ids])).last_hidden_state[0]


def _gate_firing_on(target: torch.Tensor, others: torch.Tensor, path: Path) -> Path:
    """A head whose first category fires on `target` [H] and on none of `others` [N, H]."""
    direction = target / target.norm()  # [H]
    limit = (float(target @ direction) + float((others @ direction).max())) / 2
    assert float((others @ direction).max()) < limit - 0.05 < float(target @ direction) - 0.1
    weight = torch.zeros(len(CATEGORIES) + 1, target.shape[0])
    weight[1] = direction * 50  # category 0 fires when state @ direction >= limit
    bias = torch.tensor([0.0, -50 * limit, -1e4])  # category 1 never fires
    return _write_head(path, weight, bias, "tiny")


def test_gate_fires_mid_decode_and_ends_only_that_sequence(tmp_path: Path, tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=4, max_seq_len=64, progress=False)
    prompts = [[7, 21, 33, 40, 9], [100, 3, 250, 18], [64, 64, 12]]
    ungated = [list(r.token_ids) for r in engine.generate(prompts, GREEDY_12)]
    fire_at = 4  # the gated request keeps 4 tokens: the state after its 4th token is the known one
    gated_ids = prompts[0] + ungated[0]
    states = [_final_states(tiny_dir, p + ids) for p, ids in zip(prompts, ungated, strict=True)]
    target_position = len(prompts[0]) + fire_at - 1
    others = torch.cat([states[0][len(prompts[0]) - 1 : target_position], states[1], states[2]])
    assert gated_ids[target_position] == ungated[0][fire_at - 1]
    path = _gate_firing_on(states[0][target_position], others, tmp_path / "gate.safetensors")
    loaded = open_gate(_config(path), ServedModel(("tiny",), 64), CPU)
    assert loaded.report.is_active
    engine.set_safety_gate(*loaded)

    results = engine.generate(prompts, GREEDY_12)

    assert results[0].finish_reason is FinishReason.SAFETY
    assert list(results[0].token_ids) == ungated[0][:fire_at]
    assert results[0].text.endswith(SAFE_MESSAGE)
    assert [list(r.token_ids) for r in results[1:]] == ungated[1:]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results[1:])
    assert engine.safety_gate_triggers() == {"violence": 1, "cyber": 0}
    assert engine.stats().num_free_slots == engine.max_batch_size


def test_a_tenant_policy_keeps_the_gate_from_ending_that_tenants_sequence_only(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """The same gate fires on the same state; a policy that turns the category off, or raises its
    threshold above the state's score, lets that request run on, and only that request."""
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=4, max_seq_len=64, progress=False)
    prompt = [7, 21, 33, 40, 9]
    ungated = list(engine.generate([prompt], GREEDY_12)[0].token_ids)
    states = _final_states(tiny_dir, prompt + ungated)
    target = len(prompt) + 3  # the state after the 4th generated token
    others = torch.cat([states[len(prompt) - 1 : target], states[target + 1 : target + 2]])
    direction = states[target] / states[target].norm()
    top, rest = float(states[target] @ direction), float((others @ direction).max())
    assert rest < top
    scale, limit = 2.0 / (top - rest), (top + rest) / 2  # the target's logit is 1: a score of 0.73
    weight = torch.zeros(len(CATEGORIES) + 1, states.shape[1])
    weight[1] = direction * scale
    bias = torch.tensor([0.0, -scale * limit, -1e4])  # cyber never fires
    path = _write_head(tmp_path / "gate.safetensors", weight, bias, "tiny")
    engine.set_safety_gate(*open_gate(_config(path), ServedModel(("tiny",), 64), CPU))
    score = float(gate_scores(states[target][None], load_gate(path).head_weights(ENGINE_HEAD))[0, 0])
    assert 0.5 <= score < 0.8  # fires at the gate's 0.5, not at a tenant's 0.8 or above

    def run(policy: GatePolicy | None) -> tuple[FinishReason, list[int]]:
        collector = ResultCollector(prompt)
        engine.submit(prompt, GREEDY_12, collector, gate_policy=policy)
        neighbour = ResultCollector(prompt)
        engine.submit(prompt, GREEDY_12, neighbour)  # the same request without the policy
        while not (collector.done.is_set() and neighbour.done.is_set()):
            engine.step()
        assert neighbour.result().finish_reason is FinishReason.SAFETY
        result = collector.result()
        return result.finish_reason, list(result.token_ids)

    assert run(None) == (FinishReason.SAFETY, ungated[:4])
    assert run(GatePolicy(categories_off=frozenset({"violence"}))) == (FinishReason.LENGTH, ungated)
    assert run(GatePolicy(thresholds={"violence": 0.8})) == (FinishReason.LENGTH, ungated)
    assert run(GatePolicy(thresholds={"violence": 0.6})) == (FinishReason.SAFETY, ungated[:4])
    assert run(GatePolicy(thresholds={"violence": 0.3, "cyber": 0.9})) == (FinishReason.SAFETY, ungated[:4])
    assert run(GatePolicy(categories_off=frozenset({"cyber"}))) == (FinishReason.SAFETY, ungated[:4])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"thresholds": {"violence": 0.0}}, r"must lie in \(0, 1\]"),
        ({"thresholds": {"violence": float("nan")}}, r"must lie in \(0, 1\]"),
        ({"categories_off": frozenset({""})}, "1-64 characters"),
        ({"categories_off": frozenset(f"c{i}" for i in range(65))}, "at most 64"),
    ],
)
def test_a_malformed_gate_policy_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatePolicy(**kwargs)  # type: ignore[arg-type]


def test_trigger_counter_and_gate_status_reach_the_metrics(tmp_path: Path, tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    always = _write_head(
        tmp_path / "gate.safetensors", torch.zeros(3, 64), torch.tensor([0.0, -10.0, 10.0]), "tiny"
    )
    engine.set_safety_gate(*open_gate(_config(always), ServedModel(("tiny",), 64), CPU))
    result = engine.generate([[5, 6, 7]], GREEDY_12)[0]
    assert result.finish_reason is FinishReason.SAFETY and result.token_ids == ()
    assert result.text == SAFE_MESSAGE
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in EngineCollector(engine).collect()
        for s in family.samples
    }
    trigger = ("thermocline_engine_safety_triggers_total", (("category", "cyber"), ("layer", "in_loop")))
    assert samples[trigger] == 1
    assert samples[("thermocline_engine_safety_gate_status", (("status", "unverified"),))] == 1
    assert samples[("thermocline_engine_safety_gate_status", (("status", "ok"),))] == 0


def test_gate_reads_the_sampling_rows_while_another_row_is_mid_prompt(tmp_path: Path, tiny_dir: Path) -> None:
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, max_prefill_tokens=8, progress=False
    )
    short, long = [5, 6, 7], list(range(10, 40))  # the long prompt takes several 8-token chunks
    ungated = engine.generate([short, long], GREEDY_12)
    weight = torch.zeros(3, 64)
    always = _write_head(tmp_path / "gate.safetensors", weight, torch.tensor([0.0, -10.0, 10.0]), "tiny")
    engine.set_safety_gate(*open_gate(_config(always), ServedModel(("tiny",), 64), CPU))
    gated = engine.generate([short, long], GREEDY_12)
    assert [r.finish_reason for r in ungated] == [FinishReason.LENGTH] * 2
    assert [(r.finish_reason, r.token_ids) for r in gated] == [(FinishReason.SAFETY, ())] * 2
    assert engine.safety_gate_triggers() == {"violence": 0, "cyber": 2}


# --- through the real mesh -----------------------------------------------------------------------


def _stories_gate(path: Path) -> Path:
    """The shipped gate's prompt head (the safety service screens with it) plus an engine head for
    stories260K that fires on every state, so each request ends in the engine with SAFETY."""
    shipped = load_gate(DEFAULT_GATE_FILE)
    manifest = {k: v for k, v in shipped.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = "test-stories"
    hidden_size, num_classes = 64, len(shipped.manifest.categories) + 1
    manifest["heads"][ENGINE_HEAD] = {
        "features": {"model": "stories260k", "hidden_size": hidden_size, "layer": "final_norm"},
        "thresholds": dict.fromkeys(shipped.manifest.categories, 0.5),
    }
    tensors = {name: t for name, t in shipped.tensors.items() if not name.startswith(ENGINE_HEAD)}
    tensors[f"{ENGINE_HEAD}.weight"] = torch.zeros(num_classes, hidden_size)
    tensors[f"{ENGINE_HEAD}.bias"] = torch.tensor([0.0, 10.0] + [-10.0] * (num_classes - 2))
    write_gate(path, tensors, manifest)
    return path


def _metric_lines(mesh: Mesh, service: str) -> list[str]:
    url = f"http://127.0.0.1:{mesh.config.ports.metrics[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode().splitlines()


def test_engine_fetches_the_gate_from_safety_and_the_gateway_relays_a_safety_finish(
    stories_model: Path, collector: TraceCollector, tmp_path: Path
) -> None:
    gate_path = _stories_gate(tmp_path / "gate.safetensors")
    tenants = tmp_path / "tenants.json"  # "medic" has the category the engine head fires on off
    tenants.write_text(json.dumps({"tenants": {"medic": {"safety": {"categories_off": ["violence"]}}}}))
    settings = {
        "THERMOCLINE_SAFETY_GATE_FILE": str(gate_path),
        "THERMOCLINE_ENGINE_GATE_SOURCE": "safety",
        "THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants),
    }
    mesh = start_mesh(stories_model, tmp_path / "mesh", collector, **settings)
    try:
        with mesh.channel("engine") as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest())
        gate = info.safety_gate
        assert gate.status == engine_pb2.SAFETY_GATE_STATUS_OK, gate.detail
        assert gate.version == "test-stories" and gate.is_active and not gate.is_refusing
        assert gate.sha256 == gate.announced_sha256 == load_gate(gate_path).sha256
        capacity = info.kv_capacity  # sized at start-up and reported
        assert capacity.concurrent_sequences >= 1 and capacity.hot_tokens >= info.max_context_tokens
        assert 0 < capacity.kv_cache_bytes <= capacity.budget_bytes

        token = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            request = build_request("Once upon a time", max_tokens=20)
            result = collect(stream_generate(channel, request, call_metadata(token), timeout_s=120))
        assert result.done is not None and result.done.finish_reason == gateway_pb2.FINISH_REASON_SAFETY
        assert result.text == DEFAULT_SAFE_MESSAGE

        lines = _metric_lines(mesh, "engine")
        assert 'thermocline_engine_safety_gate_status{status="ok"} 1.0' in lines
        assert 'thermocline_engine_safety_triggers_total{category="violence",layer="in_loop"} 1.0' in lines

        # the gateway passes the tenant's policy on, and the in-loop gate lets "medic" through
        medic = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="medic")
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            request = build_request("Once upon a time", max_tokens=20)
            result = collect(stream_generate(channel, request, call_metadata(medic), timeout_s=120))
        assert result.done is not None and result.done.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert result.text and result.text != DEFAULT_SAFE_MESSAGE
    finally:
        mesh.stop()
