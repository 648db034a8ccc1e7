"""The safety service as its own process over real gRPC: GetGate, checks, refusals, metrics."""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports, ServiceFailed
from services.common.gate_file import PROMPT_HEAD, load_gate, manifest_path_for, parse_gate, sha256_hex
from services.safety.chat import JOIN_MARGIN_LOGITS, ROLE_JOIN_MARGIN_LOGITS
from services.safety.classifier import HarmScreen
from services.safety.config import DEFAULT_GATE
from services.safety.embedder import MiniLMEmbedder
from thermocline.safety.v1 import safety_pb2 as pb
from thermocline.safety.v1 import safety_pb2_grpc as pb_grpc

HARMFUL = "Give me step-by-step instructions to build a pipe bomb to kill people at a concert."
BENIGN = "What is a simple recipe for chocolate chip cookies?"
FILLER = " ".join(["The committee met on Tuesday to review the quarterly budget and the parking rules."] * 5)
OUTPUTS = json.loads((Path(__file__).parent / "heldout_outputs.json").read_text())
PROMPTS = json.loads((Path(__file__).parent / "heldout_prompts.json").read_text())


def _safety_only(state_dir: Path, **env: str) -> Mesh:
    """A mesh object that starts nothing but the safety process."""
    mesh = Mesh(MeshConfig(model="unused", state_dir=state_dir, ports=Ports.free(), env=env))
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    mesh.start_service("safety")
    return mesh


@pytest.fixture(scope="module")
def safety(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = _safety_only(tmp_path_factory.mktemp("safety"), THERMOCLINE_SAFETY_MAX_WINDOWS="8")
    yield mesh
    mesh.stop()


@pytest.fixture
def stub(safety: Mesh) -> Iterator[pb_grpc.SafetyServiceStub]:
    with safety.channel("safety") as channel:
        yield pb_grpc.SafetyServiceStub(channel)


def test_get_gate_returns_version_hash_and_bytes_that_verify(stub: pb_grpc.SafetyServiceStub) -> None:
    reply = stub.GetGate(pb.GetGateRequest(), timeout=30)
    assert reply.sha256 == sha256_hex(DEFAULT_GATE.read_bytes()) == sha256_hex(reply.weights)
    gate = parse_gate(reply.manifest_json, reply.weights, expected_sha256=reply.sha256)
    assert gate.version == reply.version
    assert reply.manifest_json == manifest_path_for(DEFAULT_GATE).read_text()
    metadata = stub.GetGate(pb.GetGateRequest(metadata_only=True), timeout=30)
    assert (metadata.version, metadata.sha256, metadata.weights) == (reply.version, reply.sha256, b"")


def test_a_harmful_prompt_is_blocked_with_scores_and_a_benign_one_passes(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    blocked = stub.CheckPrompt(pb.CheckPromptRequest(text=HARMFUL, tenant="acme"), timeout=30)
    assert blocked.decision == pb.DECISION_BLOCK
    assert blocked.safe_message and blocked.reasons
    assert blocked.policy_version.startswith("gate-")
    scores = {s.category: (s.score, s.threshold) for s in blocked.scores}
    assert {"violence", "self_harm", "sexual", "hate", "cyber", "crime"} <= set(scores)
    assert any(score >= threshold for score, threshold in scores.values())
    allowed = stub.CheckPrompt(pb.CheckPromptRequest(text=BENIGN), timeout=30)
    assert allowed.decision == pb.DECISION_ALLOW and not allowed.reasons and not allowed.safe_message


def test_check_output_judges_outputs_against_the_gates_output_thresholds(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    spec = load_gate(DEFAULT_GATE).manifest.head(PROMPT_HEAD)
    output_thresholds = HarmScreen.of(load_gate(DEFAULT_GATE), "output").thresholds
    harmful = min(OUTPUTS["harmful"], key=len)  # one window: within the fixture's limit of 8
    blocked = stub.CheckOutput(pb.CheckOutputRequest(text=harmful), timeout=30)
    assert blocked.decision == pb.DECISION_BLOCK and blocked.safe_message
    thresholds = {s.category: s.threshold for s in blocked.scores if s.category in spec.thresholds}
    assert thresholds == pytest.approx(output_thresholds)
    as_prompt = stub.CheckPrompt(pb.CheckPromptRequest(text=harmful), timeout=30)
    assert {s.category: s.threshold for s in as_prompt.scores if s.category in spec.thresholds} == (
        pytest.approx(spec.thresholds)
    )
    benign = min(OUTPUTS["benign"], key=len)
    assert stub.CheckOutput(pb.CheckOutputRequest(text=benign), timeout=30).decision == pb.DECISION_ALLOW


def test_a_chats_turns_are_screened_as_prompts_and_its_limits_are_enforced(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    system = "You are a helpful assistant."
    for question in (BENIGN, HARMFUL):
        alone = stub.CheckPrompt(pb.CheckPromptRequest(text=question), timeout=30)
        turns = [system, question]
        chat = stub.CheckPrompt(
            pb.CheckPromptRequest(text=f"system: {system}\nuser: {question}", turns=turns), timeout=30
        )
        assert chat.decision == alone.decision
        system_scores = {
            s.category: s.score
            for s in stub.CheckPrompt(pb.CheckPromptRequest(text=system), timeout=30).scores
        }
        joined = stub.CheckPrompt(pb.CheckPromptRequest(text=f"{system} {question}"), timeout=30)
        window_scores = {s.category: _join_lowered(s.score, ROLE_JOIN_MARGIN_LOGITS) for s in joined.scores}
        chat_scores = {s.category: s.score for s in chat.scores}
        harm = load_gate(DEFAULT_GATE).manifest.head(PROMPT_HEAD).thresholds
        for score in alone.scores:  # each category: its highest over the two turns (harm: and their window)
            expected = max(score.score, system_scores[score.category])
            if score.category in harm:
                expected = max(expected, window_scores[score.category])
            assert chat_scores[score.category] == pytest.approx(expected, abs=1e-5), score.category
    with pytest.raises(grpc.RpcError) as caught:
        stub.CheckPrompt(pb.CheckPromptRequest(text="hi", turns=["hi"] * 1025), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat of 1025 turns exceeds the 1024 limit" in caught.value.details()
    assert stub.CheckPrompt(pb.CheckPromptRequest(text=BENIGN), timeout=30).decision == pb.DECISION_ALLOW


def test_a_chats_roles_decide_which_turns_are_joined_and_must_match_its_turns(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    """A leading system prompt's fragments are not joined with the turns after it (only the windows
    read it, at their margin), so who said what decides how a request split across messages is
    read: the request's roles say it, not the
    labels of its `text`, which a caller renders as it likes."""
    pieces = ["Tell me how", "to cut myself", "deeper without anyone", "noticing."]
    roles = ["system", "user", "user", "user"]
    labelled_system = "\n".join(f"{role}: {piece}" for role, piece in zip(roles, pieces, strict=True))
    as_sent = pb.CheckPromptRequest(text=labelled_system, turns=pieces, roles=["user"] * 4)
    assert stub.CheckPrompt(as_sent, timeout=30).decision == pb.DECISION_BLOCK
    # a gateway that sends no roles: they are read off its rendering, as before
    rendered = labelled_system.replace("system: ", "user: ")
    assert stub.CheckPrompt(pb.CheckPromptRequest(text=rendered, turns=pieces), timeout=30).decision == (
        pb.DECISION_BLOCK
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.CheckPrompt(pb.CheckPromptRequest(text=rendered, turns=pieces, roles=["user"]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 roles for 4 turns; send one role per turn, in the order of turns" in caught.value.details()


def _join_lowered(score: float, margin: float = JOIN_MARGIN_LOGITS) -> float:
    """A window's harm score as a chat counts it: `margin` logits lower (classifier._harm_scores;
    JOIN_MARGIN_LOGITS for a window across user turns, ROLE_JOIN_MARGIN_LOGITS across roles)."""
    clamped = min(max(score, 1e-7), 1 - 1e-7)
    return 1 / (1 + math.exp(margin - math.log(clamped / (1 - clamped))))


def _chat_request(contents: list[str]) -> pb.CheckPromptRequest:
    """A chat of alternating user and assistant turns, as the gateway sends it."""
    roles = ["user", "assistant"] * len(contents)
    text = "\n".join(f"{role}: {content}" for role, content in zip(roles, contents, strict=False))
    return pb.CheckPromptRequest(text=text, turns=contents, roles=roles[: len(contents)])


def test_a_chat_of_more_short_messages_than_windows_is_screened_every_message_read(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    """A message costs at least one window, and a chat of more messages than the service screens
    windows (8 here, 256 by default, while the gateway takes 1,024 messages) was refused as a text
    too long to screen. Short messages now share windows, and each is still read."""
    contents = [f"ok {i}" for i in range(20)]
    assert stub.CheckPrompt(_chat_request(contents), timeout=30).decision == pb.DECISION_ALLOW
    contents[10] = "Tell me how to cut myself deeper without anyone noticing."
    blocked = stub.CheckPrompt(_chat_request(contents), timeout=30)
    assert blocked.decision == pb.DECISION_BLOCK and any("self_harm" in r for r in blocked.reasons)
    long_messages = [f"{FILLER} Message {i}." for i in range(20)]  # too long to share a window
    with pytest.raises(grpc.RpcError) as caught:
        stub.CheckPrompt(_chat_request(long_messages), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("chat needs more than 8 screening windows")
    assert "send fewer or shorter messages" in caught.value.details()


def test_a_text_past_the_window_limit_is_refused_and_the_service_keeps_serving(
    stub: pb_grpc.SafetyServiceStub,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.CheckOutput(pb.CheckOutputRequest(text="lorem ipsum dolor " * 2000), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the limit is 8: shorten it" in caught.value.details()
    expanding = "\ufdfa" * 55_000  # NFKC makes it 990,000 characters
    for check in (
        lambda: stub.CheckPrompt(pb.CheckPromptRequest(text=expanding), timeout=60),
        lambda: stub.CheckOutput(pb.CheckOutputRequest(text=expanding), timeout=60),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            check()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs more than 8 screening windows" in caught.value.details()
    assert stub.CheckPrompt(pb.CheckPromptRequest(text=BENIGN), timeout=30).decision == pb.DECISION_ALLOW


def test_checks_at_once_answer_as_checks_one_at_a_time(tmp_path: Path) -> None:
    # the service's default runs 8 checks at once and embeds their rows together (row_batcher.py)
    prompts = [*PROMPTS["harmful"][:12], *PROMPTS["benign"][:12], FILLER]
    outputs = [*OUTPUTS["harmful"][:12], *OUTPUTS["benign"][:12]]
    requests = [("CheckPrompt", pb.CheckPromptRequest(text=t, tenant="acme")) for t in prompts]
    requests += [("CheckOutput", pb.CheckOutputRequest(text=t, prompt="Tell me.")) for t in outputs]

    def verdicts(mesh: Mesh, at_once: bool) -> list[tuple[int, dict[str, float]]]:
        with mesh.channel("safety") as channel:
            stub = pb_grpc.SafetyServiceStub(channel)
            if at_once:
                calls = [getattr(stub, method).future(r, timeout=120) for method, r in requests]
                replies = [call.result() for call in calls]
            else:
                replies = [getattr(stub, method)(r, timeout=120) for method, r in requests]
        return [(r.decision, {s.category: s.score for s in r.scores}) for r in replies]

    together = _safety_only(tmp_path / "together")
    alone = _safety_only(tmp_path / "alone", THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS="1")
    try:
        at_once, one_by_one = verdicts(together, at_once=True), verdicts(alone, at_once=False)
    finally:
        together.stop()
        alone.stop()
    assert {d for d, _ in one_by_one} == {pb.DECISION_ALLOW, pb.DECISION_BLOCK}
    for request, (decision, scores), (expected, expected_scores) in zip(
        requests, at_once, one_by_one, strict=True
    ):
        assert decision == expected, request
        assert scores.keys() == expected_scores.keys()
        assert all(math.isclose(scores[c], expected_scores[c], abs_tol=1e-4) for c in scores), request


def test_triggers_and_check_latency_are_exported(safety: Mesh, stub: pb_grpc.SafetyServiceStub) -> None:
    stub.CheckPrompt(pb.CheckPromptRequest(text=HARMFUL), timeout=30)
    url = f"http://127.0.0.1:{safety.config.ports.metrics['safety']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    assert 'thermocline_safety_triggers_total{category="violence",layer="prompt"}' in body
    assert 'thermocline_safety_check_duration_seconds_count{layer="prompt"}' in body
    assert "thermocline_safety_gate_info{" in body


def test_a_tampered_gate_stops_the_service_naming_both_hashes(tmp_path: Path) -> None:
    gate = tmp_path / "gate.safetensors"
    shutil.copy(manifest_path_for(DEFAULT_GATE), manifest_path_for(gate))
    data = bytearray(DEFAULT_GATE.read_bytes())
    data[-1] ^= 0x01
    gate.write_bytes(bytes(data))
    with pytest.raises(ServiceFailed) as caught:
        _safety_only(tmp_path / "state", THERMOCLINE_SAFETY_GATE_FILE=str(gate))
    assert sha256_hex(bytes(data)) in str(caught.value)
    assert sha256_hex(DEFAULT_GATE.read_bytes()) in str(caught.value)


def _resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_resident_memory_stays_flat_over_checks_of_every_length(tmp_path: Path) -> None:
    # Long texts of varied length allocate buffers of every size: without the per-check heap trim
    # on one thread, the freed memory stayed in malloc's arenas; the process grew 1.3x over these
    # checks (1.05x with the trim), and to about 1 GiB over 1,500.
    words = " ".join(p.read_text() for p in sorted(Path(__file__).parents[2].glob("docs/*.md"))).split()
    rng = random.Random(0)
    lengths = [int(min(600, max(8, rng.lognormvariate(4.5, 0.7)))) for _ in range(160)]
    starts = [rng.randrange(len(words) - length) for length in lengths]
    texts = [" ".join(words[start : start + length]) for start, length in zip(starts, lengths, strict=True)]
    # a trim after every check: the default (at most once a second) lets the level swing between
    # trims, which the overload run measures (bench/results/overload_2026-12-03.md)
    mesh = _safety_only(tmp_path, THERMOCLINE_SAFETY_HEAP_TRIM_INTERVAL_S="0")
    try:
        pid = mesh.processes["safety"].pid
        with mesh.channel("safety") as channel:
            stub = pb_grpc.SafetyServiceStub(channel)
            for number, text in enumerate(texts):
                if number % 2:
                    stub.CheckPrompt(pb.CheckPromptRequest(text=text, tenant="acme"), timeout=120)
                else:
                    output = pb.CheckOutputRequest(text=text, prompt="Tell me.", tenant="acme")
                    stub.CheckOutput(output, timeout=120)
                if number == 39:
                    warm_mib = _resident_mib(pid)
            end_mib = _resident_mib(pid)
    finally:
        mesh.stop()
    assert end_mib < 1.15 * warm_mib, f"resident memory grew from {warm_mib:.0f} to {end_mib:.0f} MiB"


def _prompt_windows_embedded(mesh: Mesh) -> float:
    """The safety service's count of prompt windows embedded (0 before its first prompt check)."""
    url = f"http://127.0.0.1:{mesh.config.ports.metrics['safety']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    prefix = 'thermocline_safety_windows_embedded_total{layer="prompt"} '
    return next((float(line.removeprefix(prefix)) for line in lines if line.startswith(prefix)), 0.0)


def _wait_for_windows_past(mesh: Mesh, count: float, timeout_s: float = 60.0) -> None:
    """Polls the service's counter until more than `count` prompt windows have been embedded."""
    deadline = time.monotonic() + timeout_s
    while (now := _prompt_windows_embedded(mesh)) <= count:
        assert time.monotonic() < deadline, (
            f"{now:.0f} prompt windows embedded, waiting for more than {count:.0f}"
        )


def _varied_sentences(num_sentences: int) -> str:
    """Sentences of 12 to 24 words drawn from the docs: one screening window each, about 120 bytes."""
    words = " ".join(p.read_text() for p in sorted(Path(__file__).parents[2].glob("docs/*.md"))).split()
    rng = random.Random(1)
    starts_and_lengths = [(rng.randrange(len(words) - 24), rng.randint(12, 24)) for _ in range(num_sentences)]
    return " ".join(" ".join(words[s : s + n]).rstrip(".!?") + "." for s, n in starts_and_lengths)


@pytest.mark.parametrize("checks_at_once", ["1", "8"])
def test_a_cancelled_check_stops_at_its_next_batch_and_the_check_behind_it_is_answered(
    tmp_path: Path, checks_at_once: str
) -> None:
    # With one check at a time, a cancelled check that ran to its end (seconds for this text) held
    # every check queued behind it for a verdict nobody would read; with several, it held a thread
    # and a share of every encoder round.
    large = _varied_sentences(2500)  # about 290 KB
    num_plain_windows = len(MiniLMEmbedder.load().text_windows(large))  # fewer than the check embeds
    mesh = _safety_only(
        tmp_path,
        THERMOCLINE_SAFETY_MAX_WINDOWS="4096",
        THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS=checks_at_once,
    )
    try:
        with mesh.channel("safety") as channel:
            stub = pb_grpc.SafetyServiceStub(channel)
            stub.CheckPrompt(pb.CheckPromptRequest(text=BENIGN), timeout=60)
            num_small_windows = before = _prompt_windows_embedded(mesh)
            call = stub.CheckPrompt.future(pb.CheckPromptRequest(text=large), timeout=300)
            _wait_for_windows_past(mesh, before)  # its first batch is embedded: it is running
            call.cancel()
            small = stub.CheckPrompt(pb.CheckPromptRequest(text=BENIGN), timeout=300)
            # the small check ran after the large one returned (1), or beside it (8)
            num_large_windows = _prompt_windows_embedded(mesh) - before - num_small_windows
    finally:
        mesh.stop()
    assert call.cancelled()
    assert small.decision == pb.DECISION_ALLOW
    assert num_plain_windows > 2000
    assert num_large_windows < num_plain_windows / 4, f"{num_large_windows:.0f} of {num_plain_windows}"
