"""The gate file: the committed gate verifies, a changed file is refused, the reference head fires."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.gate_file import (
    ENGINE_HEAD,
    OUTPUT_HEAD,
    PROMPT_HEAD,
    GateFileError,
    GateHashMismatch,
    GateManifestMismatch,
    HeadWeights,
    gate_scores,
    load_gate,
    manifest_digest,
    manifest_path_for,
    parse_gate,
    seal_gate,
    sha256_hex,
    write_gate,
)
from services.safety.classifier import HarmScreen
from services.safety.config import DEFAULT_GATE


def test_the_committed_gate_verifies_and_names_what_each_head_reads() -> None:
    gate = load_gate(DEFAULT_GATE)
    assert gate.sha256 == sha256_hex(DEFAULT_GATE.read_bytes())
    # One GetGate reply carries the file (the services' default message limit is 16 MiB); the
    # fine-tuned encoder's adapters are most of it.
    assert DEFAULT_GATE.stat().st_size < 2_000_000
    engine = gate.manifest.head(ENGINE_HEAD)
    assert engine.features["model"] == "smollm2-135m-instruct"
    assert engine.features["layer"] == "final_norm"
    weights = gate.head_weights(ENGINE_HEAD)
    assert weights.weight.shape == (len(gate.manifest.categories) + 1, engine.features["hidden_size"])
    assert gate.head_weights(PROMPT_HEAD).weight.shape[1] == 384


def _copy_gate(tmp_path: Path) -> Path:
    target = tmp_path / "gate.safetensors"
    shutil.copy(DEFAULT_GATE, target)
    shutil.copy(manifest_path_for(DEFAULT_GATE), manifest_path_for(target))
    return target


def test_a_changed_weights_file_is_refused_naming_both_hashes(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(GateHashMismatch) as caught:
        load_gate(path)
    message = str(caught.value)
    assert sha256_hex(bytes(data)) in message
    assert load_gate(DEFAULT_GATE).sha256 in message


def test_a_hash_announced_by_the_safety_service_must_match_too() -> None:
    gate = load_gate(DEFAULT_GATE)
    with pytest.raises(GateHashMismatch, match=r"announced sha256 is 0{64}"):
        parse_gate(gate.manifest_json, gate.weights_bytes, expected_sha256="0" * 64)
    assert parse_gate(gate.manifest_json, gate.weights_bytes, gate.sha256).version == gate.version


def test_a_manifest_without_every_threshold_is_refused(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)
    manifest = json.loads(manifest_path_for(path).read_text())
    del manifest["heads"][ENGINE_HEAD]["thresholds"]["hate"]
    manifest_path_for(path).write_text(json.dumps(manifest))
    with pytest.raises(GateFileError, match="thresholds must name exactly the categories"):
        load_gate(path)


def _one_hot_gate(tmp_path: Path, hidden_size: int = 8) -> Path:
    """A gate whose engine head fires `violence` on exactly the hidden state e_0."""
    categories = ["violence", "hate"]
    weight = torch.zeros(3, hidden_size)
    weight[1, 0] = 20.0  # violence <- dimension 0
    weight[2, 1] = 20.0  # hate <- dimension 1
    tensors = {f"{ENGINE_HEAD}.weight": weight, f"{ENGINE_HEAD}.bias": torch.zeros(3)}
    features = {"model": "tiny", "layer": "final_norm", "hidden_size": hidden_size}
    head = {"features": features, "thresholds": {"violence": 0.9, "hate": 0.9}}
    path = tmp_path / "one_hot.safetensors"
    write_gate(path, tensors, {"version": "test.1", "categories": categories, "heads": {ENGINE_HEAD: head}})
    return path


def test_gate_scores_fire_for_the_one_row_that_carries_the_known_state(tmp_path: Path) -> None:
    weights: HeadWeights = load_gate(_one_hot_gate(tmp_path)).head_weights(ENGINE_HEAD)
    hidden = torch.zeros(4, 8)  # [B, H]
    hidden[2, 0] = 1.0  # row 2 carries the violence state
    hidden[3, 2] = 1.0  # row 3 is unrelated
    fired = gate_scores(hidden.to(torch.bfloat16), weights) >= weights.thresholds  # [B, C]
    assert fired.tolist() == [[False, False], [False, False], [True, False], [False, False]]


def test_output_thresholds_are_read_and_a_manifest_without_them_screens_outputs_with_its_thresholds(
    tmp_path: Path,
) -> None:
    path = _one_hot_gate(tmp_path)
    assert load_gate(path).head_weights(ENGINE_HEAD, for_outputs=True).thresholds.tolist() == [
        pytest.approx(0.9),
        pytest.approx(0.9),
    ]
    manifest = json.loads(manifest_path_for(path).read_text())
    manifest["heads"][ENGINE_HEAD]["output_thresholds"] = {"violence": 0.95, "hate": 0.99}
    manifest_path_for(path).write_text(json.dumps(manifest))
    seal_gate(path)
    gate = load_gate(path)
    assert gate.manifest.head(ENGINE_HEAD).output_thresholds == {"violence": 0.95, "hate": 0.99}
    assert gate.head_weights(ENGINE_HEAD, for_outputs=True).thresholds.tolist() == [
        pytest.approx(0.95),
        pytest.approx(0.99),
    ]
    assert gate.head_weights(ENGINE_HEAD).thresholds.tolist() == [pytest.approx(0.9)] * 2


@pytest.mark.parametrize(
    ("output_thresholds", "problem"),
    [
        ({"violence": 0.95}, "must name exactly the categories"),
        ({"violence": 0.9, "hate": 1.5}, r"must lie in \(0, 1\]"),
    ],
)
def test_bad_output_thresholds_are_refused(
    tmp_path: Path, output_thresholds: dict[str, float], problem: str
) -> None:
    path = _one_hot_gate(tmp_path)
    manifest = json.loads(manifest_path_for(path).read_text())
    manifest["heads"][ENGINE_HEAD]["output_thresholds"] = output_thresholds
    manifest_path_for(path).write_text(json.dumps(manifest))
    with pytest.raises(GateFileError, match=f"output_thresholds {problem}"):
        load_gate(path)


def test_the_committed_gate_screens_outputs_with_their_own_thresholds() -> None:
    # Each surface is calibrated on benign text of its own kind (tools/calibrate_safety_gate.py), so
    # an output threshold may land on either side of its prompt threshold (gate 2026.12.01.3:
    # violence 0.947 for outputs, 0.967 for prompts); it must not be a copy of the prompt's.
    # Since 2026.12.07 the output screen is a head of its own (OUTPUT_HEAD); HarmScreen.of reads
    # either form.
    gate = load_gate(DEFAULT_GATE)
    outputs = HarmScreen.of(gate, "output").thresholds
    assert set(outputs) == set(gate.manifest.categories)
    assert outputs != HarmScreen.of(gate, "prompt").thresholds
    assert all(0.0 < t < 1.0 for t in outputs.values())


# --- the manifest's own hash (format 2) ----------------------------------------------------------


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads(manifest_path_for(path).read_text())
    edit(manifest)
    manifest_path_for(path).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _thresholds_to_one(manifest: dict[str, Any]) -> None:
    for head in manifest["heads"].values():
        head["thresholds"] = dict.fromkeys(head["thresholds"], 1.0)


def test_the_committed_manifest_is_sealed_and_its_hash_covers_the_thresholds() -> None:
    gate = load_gate(DEFAULT_GATE)
    assert gate.manifest.raw["format"] == "thermocline-gate/2"
    assert gate.manifest_sha256 == manifest_digest(gate.manifest.raw)
    edited = json.loads(gate.manifest_json)
    edited["heads"][PROMPT_HEAD]["thresholds"]["violence"] = 1.0
    assert manifest_digest(edited) != gate.manifest_sha256


def test_a_manifest_whose_thresholds_were_edited_is_refused_naming_both_hashes(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)
    sealed = load_gate(path).manifest_sha256
    _edit_manifest(path, _thresholds_to_one)
    with pytest.raises(GateManifestMismatch, match="edited after it was written") as caught:
        load_gate(path)
    tampered = json.loads(manifest_path_for(path).read_text())
    assert sealed in str(caught.value) and manifest_digest(tampered) in str(caught.value)
    with pytest.raises(GateManifestMismatch):  # the same bytes as a GetGate reply carries them
        parse_gate(manifest_path_for(path).read_text(), path.read_bytes())


def test_a_format_1_manifest_is_refused_until_it_is_sealed(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)

    def unsealed(manifest: dict[str, Any]) -> None:
        manifest["format"] = "thermocline-gate/1"
        del manifest["manifest_sha256"]

    _edit_manifest(path, unsealed)
    with pytest.raises(GateFileError, match=r"hashes the weights only.*gate_file seal"):
        load_gate(path)
    seal_gate(path)
    assert load_gate(path).manifest_sha256 == load_gate(DEFAULT_GATE).manifest_sha256


def test_a_deliberate_edit_sealed_again_loads_as_another_manifest(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)
    _edit_manifest(path, _thresholds_to_one)
    sealed = seal_gate(path)
    gate = load_gate(path)
    assert gate.manifest_sha256 == sealed != load_gate(DEFAULT_GATE).manifest_sha256
    assert gate.sha256 == load_gate(DEFAULT_GATE).sha256  # the weights are the same
    assert set(gate.manifest.head(PROMPT_HEAD).thresholds.values()) == {1.0}


def test_sealing_refuses_weights_that_are_not_the_manifests(tmp_path: Path) -> None:
    path = _copy_gate(tmp_path)
    path.write_bytes(path.read_bytes()[:-1] + b" ")
    with pytest.raises(GateHashMismatch, match="not sealed"):
        seal_gate(path)


def test_the_manifest_hash_does_not_depend_on_layout_or_key_order(tmp_path: Path) -> None:
    gate = load_gate(_one_hot_gate(tmp_path))
    compact = json.dumps(dict(reversed(list(gate.manifest.raw.items()))))
    assert parse_gate(compact, gate.weights_bytes).manifest_sha256 == gate.manifest_sha256


def _tampered_gate(tmp_path: Path, key: str, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """The committed gate with one tensor replaced, written and sealed by the repo's own writer."""
    gate = load_gate(DEFAULT_GATE)
    tensors = dict(gate.tensors) | {key: tensor(gate.tensors[key])}
    path = tmp_path / "tampered.safetensors"
    write_gate(path, tensors, json.loads(gate.manifest_json))
    return path


@pytest.mark.parametrize("key", [f"{PROMPT_HEAD}.weight", f"{ENGINE_HEAD}.bias", "jailbreak.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_gate_with_a_tensor_that_is_not_finite_is_refused(tmp_path: Path, key: str, value: float) -> None:
    """The reviewer's hostile gate: a prompt head of NaN loaded, and then nothing ever blocked."""
    path = _tampered_gate(tmp_path, key, lambda t: torch.full_like(t, value))
    with pytest.raises(GateFileError, match=f"tensor '{key}' holds NaN or infinite values"):
        load_gate(path)


@pytest.mark.parametrize(("head", "width"), [(PROMPT_HEAD, 100), (OUTPUT_HEAD, 383), (ENGINE_HEAD, 100)])
def test_a_head_narrower_or_wider_than_what_it_reads_is_refused(
    tmp_path: Path, head: str, width: int
) -> None:
    """A [C + 1, 100] prompt head loaded, and then every check failed INTERNAL."""
    path = _tampered_gate(tmp_path, f"{head}.weight", lambda t: t[:, :width].contiguous())
    num_classes = len(load_gate(DEFAULT_GATE).manifest.categories) + 1
    expected = load_gate(DEFAULT_GATE).head_weights(head).weight.shape[1]
    with pytest.raises(
        GateFileError,
        match=rf"head '{head}' has weight \({num_classes}, {width}\).*\[{num_classes}, {expected}\]",
    ):
        load_gate(path)
