"""The re-check of safety's announced gate: its rules in process, then a real engine against a real
safety service that is restarted with another gate while the engine serves."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import zlib
from pathlib import Path

import grpc
import pytest
import torch

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.common.gate_file import ENGINE_HEAD, load_gate, manifest_path_for, write_gate
from services.engine.config import EngineConfig
from services.engine.gate.gate_loader import (
    DEFAULT_GATE_FILE,
    Announcement,
    GateConfig,
    GateSource,
    LoadedGate,
    MismatchPolicy,
    ServedModel,
    hold_gate,
)
from services.engine.gate.gate_watch import GateWatch
from services.engine.gate.safety_gate import GateRefused, GateReport, GateStatus, InLoopGate
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import FinishReason
from services.engine.serving.generation_result import ResultCollector
from tests.engine.gate.test_safety_gate import _random_gate, _write_head
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

CPU = torch.device("cpu")
TINY = ServedModel(("tiny",), 64)
SAFETY = "127.0.0.1:1"  # never dialled by the in-process tests: they hand the watch its answers
# between GetModelInfo polls: a tight loop would take a core from the services it waits on (CI has 2);
# a poll interval, not synchronisation: the engine re-checks every 0.5 s (_safety_and_engine)
POLL_INTERVAL_S = 0.05


def _announce(path: Path) -> Announcement:
    """What safety's GetGate (metadata only) says for the gate at `path`."""
    manifest = json.loads(manifest_path_for(path).read_text())
    return Announcement(manifest["version"], manifest["sha256"], "", b"")


def _watch(path: Path, announced: Announcement | None, **overrides: object) -> GateWatch:
    """A watch over the gate at `path`, whose start-up check got `announced` from safety."""
    config = GateConfig(file=path, safety_target=SAFETY, **overrides)  # type: ignore[arg-type]
    ask = "services.engine.gate.gate_loader.ask_safety"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ask, lambda config: announced)
        return GateWatch(config, TINY, hold_gate(config, TINY, CPU))


def _recheck(watch: GateWatch, announced: Announcement | None) -> LoadedGate | None:
    """One re-check whose install the engine accepts: what it installed, or None when nothing changed."""
    installed: list[LoadedGate] = []
    asyncio.run(watch.update(announced, lambda head, report: installed.append(LoadedGate(head, report))))
    return installed[0] if installed else None


@pytest.fixture
def gates(tmp_path: Path) -> tuple[Path, Path]:
    """Two gates for the tiny model that differ in their weights."""
    first = _random_gate(tmp_path / "a.safetensors", 64, seed=0)
    return first, _random_gate(tmp_path / "b.safetensors", 64, seed=1)


# --- the rules, in process -----------------------------------------------------------------------


def test_another_announced_gate_refuses_and_the_held_one_announced_again_lifts_it(
    gates: tuple[Path, Path],
) -> None:
    held, other = gates
    watch = _watch(held, _announce(held))
    head = watch.loaded.head
    assert watch.loaded.report.status is GateStatus.OK and head is not None
    assert _recheck(watch, _announce(held)) is None  # nothing changed: nothing to install

    mismatch = _recheck(watch, _announce(other))
    assert mismatch is not None and mismatch.head is head  # the held gate keeps running
    report = mismatch.report
    assert report.status is GateStatus.MISMATCH and report.is_refusing and report.is_active
    assert report.announced_sha256 == _announce(other).sha256 != report.sha256
    assert "re-checked every 30 s" in report.detail

    cleared = _recheck(watch, _announce(held))
    assert cleared is not None and cleared.head is head
    assert cleared.report.status is GateStatus.OK and not cleared.report.is_refusing


def test_no_answer_turns_ok_unverified_and_leaves_a_mismatch_refusing(gates: tuple[Path, Path]) -> None:
    held, other = gates
    watch = _watch(held, _announce(held))
    unverified = _recheck(watch, None)
    assert unverified is not None and unverified.head is watch.held.loaded.head
    report = unverified.report
    assert report.status is GateStatus.UNVERIFIED and report.is_active and not report.is_refusing
    assert report.announced_sha256 == _announce(held).sha256  # what safety said last

    refusing = _watch(held, _announce(other))
    assert refusing.loaded.report.is_refusing
    assert _recheck(refusing, None) is None  # only an answer that matches lifts a refusal
    assert refusing.loaded.report.status is GateStatus.MISMATCH and refusing.loaded.report.is_refusing


def test_a_gate_fetched_from_safety_is_not_swapped_but_reported_per_the_policy(
    gates: tuple[Path, Path],
) -> None:
    held, other = gates
    for policy, is_refusing in ((MismatchPolicy.REFUSE, True), (MismatchPolicy.WARN, False)):
        fetched = _announce(held)._replace(
            manifest_json=manifest_path_for(held).read_text(), weights=held.read_bytes()
        )
        watch = _watch(held, fetched, source=GateSource.SAFETY, mismatch=policy)
        assert watch.loaded.report.status is GateStatus.OK
        changed = _recheck(watch, _announce(other))
        assert changed is not None and changed.head is watch.held.loaded.head
        assert changed.report.sha256 == _announce(held).sha256  # still the gate it fetched
        assert changed.report.status is GateStatus.MISMATCH and changed.report.is_refusing is is_refusing
        assert "restart it to load t1" in changed.report.detail


def test_an_install_that_raises_is_tried_again_at_the_next_recheck(
    gates: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch follows the engine only once an install returns: had it moved first, every later
    re-check would see nothing changed, and the engine would keep the old report for good."""
    held, other = gates
    watch = _watch(held, _announce(held), recheck_s=0.01)
    num_asks, fourth_ask = 0, asyncio.Event()

    async def safety_announces_other(stub: object) -> Announcement:
        nonlocal num_asks
        num_asks += 1
        if num_asks == 4:
            fourth_ask.set()
        return _announce(other)

    installed: list[GateReport] = []

    def install_failing_once(head: InLoopGate | None, report: GateReport) -> None:
        installed.append(report)
        if len(installed) == 1:
            raise RuntimeError("the engine could not take the gate")

    async def scenario() -> None:
        monkeypatch.setattr(watch, "_ask", safety_announces_other)
        watch.start(install_failing_once)
        await asyncio.wait_for(fourth_ask.wait(), 30)
        await watch.stop()

    asyncio.run(scenario())
    # the first install raised, the second re-check tried again, the third and fourth had nothing to do
    assert [report.status for report in installed] == [GateStatus.MISMATCH, GateStatus.MISMATCH]
    assert watch.loaded.report is installed[1]


def test_the_watch_runs_only_with_a_gate_a_safety_service_and_a_period(gates: tuple[Path, Path]) -> None:
    held, _ = gates
    assert _watch(held, _announce(held)).is_enabled
    assert not _watch(held, _announce(held), recheck_s=0).is_enabled
    off = GateConfig(source=GateSource.OFF, safety_target=SAFETY)
    assert not GateWatch(off, TINY, hold_gate(off, TINY, CPU)).is_enabled
    local = GateConfig(file=held)
    assert not GateWatch(local, TINY, hold_gate(local, TINY, CPU)).is_enabled


def test_the_recheck_period_is_read_from_the_environment_and_checked() -> None:
    assert EngineConfig.from_env({}).gate.recheck_s == 30
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_GATE_RECHECK_S": "0"}).gate.recheck_s == 0
    with pytest.raises(ValueError, match="THERMOCLINE_ENGINE_GATE_RECHECK_S must be >= 0"):
        EngineConfig.from_env({"THERMOCLINE_ENGINE_GATE_RECHECK_S": "-1"})


def test_a_refusal_from_a_recheck_keeps_gating_admitted_streams_and_their_counts(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """A stream admitted before the refusal still ends by the gate, whose trigger counts carry on."""
    always = _write_head(
        tmp_path / "a.safetensors", torch.zeros(3, 64), torch.tensor([0.0, -10.0, 10.0]), "tiny"
    )
    other = _random_gate(tmp_path / "b.safetensors", 64, seed=1)
    watch = _watch(always, _announce(always))
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    engine.set_safety_gate(*watch.loaded)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert engine.generate([[5, 6, 7]], params)[0].finish_reason is FinishReason.SAFETY
    admitted = ResultCollector([5, 6, 7])
    engine.submit([5, 6, 7], params, admitted)

    asyncio.run(watch.update(_announce(other), engine.set_safety_gate))
    assert watch.loaded.report.is_refusing
    with pytest.raises(GateRefused, match="announces gate t1"):
        engine.submit([5, 6, 7], params, lambda event: None)
    while not admitted.done.is_set():
        engine.step()
    assert admitted.result().finish_reason is FinishReason.SAFETY
    assert engine.safety_gate_triggers() == {"violence": 0, "cyber": 2}


# --- a real engine against a real safety service -------------------------------------------------


def _stories_gate(path: Path, version: str) -> Path:
    """The shipped gate's heads (safety screens with them) plus an engine head for stories260K that
    never fires; its weights come from `version`, so each version has its own sha256."""
    shipped = load_gate(DEFAULT_GATE_FILE)
    manifest = {k: v for k, v in shipped.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = version
    hidden_size, num_classes = 64, len(shipped.manifest.categories) + 1
    manifest["heads"][ENGINE_HEAD] = {
        "features": {"model": "stories260k", "hidden_size": hidden_size, "layer": "final_norm"},
        "thresholds": dict.fromkeys(shipped.manifest.categories, 0.5),
    }
    generator = torch.Generator().manual_seed(zlib.crc32(version.encode()))
    tensors = {name: t for name, t in shipped.tensors.items() if not name.startswith(ENGINE_HEAD)}
    tensors[f"{ENGINE_HEAD}.weight"] = torch.randn(num_classes, hidden_size, generator=generator) * 1e-3
    tensors[f"{ENGINE_HEAD}.bias"] = torch.tensor([0.0] + [-1e4] * (num_classes - 1))
    write_gate(path, tensors, manifest)
    return path


def _safety_and_engine(state_dir: Path, model: Path, safety_gate: Path, **env: str) -> Mesh:
    """A safety process on `safety_gate` and an engine that re-checks it twice a second."""
    settings = {
        "THERMOCLINE_SAFETY_GATE_FILE": str(safety_gate),
        "THERMOCLINE_ENGINE_GATE_RECHECK_S": "0.5",
        "THERMOCLINE_ENGINE_KVSTORE_TARGET": "",  # no kvstore: no cold tier
        **env,
    }
    mesh = Mesh(MeshConfig(model=str(model), state_dir=state_dir, ports=Ports.free(), env=settings))
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        mesh.start_service("safety")
        mesh.start_service("engine")
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _restart_safety(mesh: Mesh, gate: Path) -> None:
    """Safety redeployed with another gate file while the engine runs."""
    process = mesh.processes["safety"]
    process.terminate()
    process.wait(60)
    mesh.config.env["THERMOCLINE_SAFETY_GATE_FILE"] = str(gate)
    mesh.start_service("safety")


def _gate_info(mesh: Mesh) -> engine_pb2.SafetyGateInfo:
    with mesh.channel("engine") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        return stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10).safety_gate


def _wait_for_gate(mesh: Mesh, status: int, timeout_s: float = 60) -> engine_pb2.SafetyGateInfo:
    """Polls GetModelInfo every POLL_INTERVAL_S until the engine reports `status`."""
    deadline = time.monotonic() + timeout_s
    while (gate := _gate_info(mesh)).status != status:
        assert time.monotonic() < deadline, (
            f"no {engine_pb2.SafetyGateStatus.Name(status)} after {timeout_s} s: {gate}\n"
            f"{mesh.log_tail('engine')}"
        )
        time.sleep(POLL_INTERVAL_S)
    return gate


def _generate_code(mesh: Mesh) -> grpc.StatusCode:
    """The status of one short Generate straight to the engine."""
    request = engine_pb2.GenerateRequest(
        prompt="Once upon a time", sampling=engine_pb2.SamplingParams(max_tokens=4)
    )
    with mesh.channel("engine") as channel:
        try:
            list(engine_pb2_grpc.EngineServiceStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _gate_status_metric(mesh: Mesh) -> str:
    """The status that thermocline_engine_safety_gate_status marks with 1."""
    url = f"http://127.0.0.1:{mesh.config.ports.metrics['engine']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    prefix = 'thermocline_engine_safety_gate_status{status="'
    (status,) = [
        line[len(prefix) :].split('"')[0]
        for line in lines
        if line.startswith(prefix) and line.endswith(" 1.0")
    ]
    return status


def test_safety_restarted_with_another_gate_turns_the_engine_to_mismatch_and_back(
    stories_model: Path, tmp_path: Path
) -> None:
    """GATE_SOURCE=safety: the engine keeps the gate it fetched, refuses while safety announces
    another, and serves again once safety is back on its gate, all without an engine restart; with
    safety gone, the gate turns unverified and keeps serving."""
    gate_a, gate_b = (
        _stories_gate(tmp_path / "a.safetensors", "a"),
        _stories_gate(tmp_path / "b.safetensors", "b"),
    )
    mesh = _safety_and_engine(
        tmp_path / "mesh",
        stories_model,
        gate_a,
        THERMOCLINE_ENGINE_GATE_SOURCE="safety",
        THERMOCLINE_ENGINE_SAFETY_TIMEOUT_S="2",  # how long a re-check waits for a safety that is gone
    )
    try:
        ok = _gate_info(mesh)
        assert ok.status == engine_pb2.SAFETY_GATE_STATUS_OK and ok.version == "a", ok
        assert _generate_code(mesh) == grpc.StatusCode.OK

        _restart_safety(mesh, gate_b)
        gate = _wait_for_gate(mesh, engine_pb2.SAFETY_GATE_STATUS_MISMATCH)
        assert gate.is_refusing and gate.is_active
        assert (gate.version, gate.sha256) == ("a", load_gate(gate_a).sha256)  # not swapped
        assert gate.announced_sha256 == load_gate(gate_b).sha256
        assert "restart it to load b" in gate.detail
        assert _gate_status_metric(mesh) == "mismatch"
        assert _generate_code(mesh) == grpc.StatusCode.FAILED_PRECONDITION

        _restart_safety(mesh, gate_a)
        gate = _wait_for_gate(mesh, engine_pb2.SAFETY_GATE_STATUS_OK)
        assert not gate.is_refusing and gate.announced_sha256 == gate.sha256
        assert _gate_status_metric(mesh) == "ok"
        assert _generate_code(mesh) == grpc.StatusCode.OK

        mesh.processes["safety"].kill()
        mesh.processes["safety"].wait(60)
        gate = _wait_for_gate(mesh, engine_pb2.SAFETY_GATE_STATUS_UNVERIFIED)
        assert gate.is_active and not gate.is_refusing and "did not answer" in gate.detail
        assert _generate_code(mesh) == grpc.StatusCode.OK
    finally:
        mesh.stop()


def test_an_engine_that_started_refusing_serves_once_safety_announces_its_gate(
    stories_model: Path, tmp_path: Path
) -> None:
    """GATE_SOURCE=file: the operator mends a start-up mismatch by deploying the engine's gate to safety."""
    gate_a, gate_b = (
        _stories_gate(tmp_path / "a.safetensors", "a"),
        _stories_gate(tmp_path / "b.safetensors", "b"),
    )
    mesh = _safety_and_engine(
        tmp_path / "mesh", stories_model, gate_b, THERMOCLINE_ENGINE_GATE_FILE=str(gate_a)
    )
    try:
        refusing = _gate_info(mesh)
        assert refusing.status == engine_pb2.SAFETY_GATE_STATUS_MISMATCH and refusing.is_refusing, refusing
        assert _generate_code(mesh) == grpc.StatusCode.FAILED_PRECONDITION

        _restart_safety(mesh, gate_a)
        gate = _wait_for_gate(mesh, engine_pb2.SAFETY_GATE_STATUS_OK)
        assert gate.is_active and not gate.is_refusing
        assert gate.announced_sha256 == gate.sha256 == load_gate(gate_a).sha256
        assert _gate_status_metric(mesh) == "ok"
        assert _generate_code(mesh) == grpc.StatusCode.OK
    finally:
        mesh.stop()
