"""tools/train_safety_gate.py rewrites the gate's category heads and keeps what other tools trained."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from services.common.gate_file import (
    ENGINE_HEAD,
    MANIFEST_HASH_KEY,
    PROMPT_HEAD,
    load_gate,
    manifest_path_for,
    write_gate,
)
from services.safety.attack_head import ATTACK_HEADS, AttackHead
from services.safety.config import DEFAULT_GATE
from services.safety.encoder_adapters import ADAPTERS_KEY, EncoderAdapters
from tools import train_safety_gate
from tools.safety_data import BENIGN, CATEGORIES, Example
from tools.train_safety_gate import carried_parts


def test_a_rewritten_gate_keeps_the_attack_heads_and_the_encoder_adapters(tmp_path: Path) -> None:
    """The shipped gate has two attack heads and a fine-tuned encoder: a gate written from its own
    category heads plus carried_parts loads with the same heads and adapters."""
    shipped = load_gate(DEFAULT_GATE)
    carried, entries = carried_parts(DEFAULT_GATE)
    assert set(entries) == {ATTACK_HEADS, ADAPTERS_KEY}
    own = {k: v for k, v in shipped.tensors.items() if k not in carried}
    manifest = {
        k: v for k, v in shipped.manifest.raw.items() if k not in entries and k not in ("format", "sha256")
    }
    out = tmp_path / "gate.safetensors"
    write_gate(out, own | carried, manifest | entries)

    rewritten = load_gate(out)
    before, after = AttackHead.all_from_gate(shipped), AttackHead.all_from_gate(rewritten)
    assert [h.name for h in after] == [h.name for h in before] and len(after) >= 2
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.weight, new.weight) and old.bias == new.bias and old.threshold == new.threshold
    old_adapters, new_adapters = EncoderAdapters.from_gate(shipped), EncoderAdapters.from_gate(rewritten)
    assert old_adapters is not None and new_adapters is not None
    assert all(torch.equal(t, new_adapters.tensors()[k]) for k, t in old_adapters.tensors().items())


def test_a_gate_with_nothing_to_carry_carries_nothing(tmp_path: Path) -> None:
    absent = tmp_path / "absent.safetensors"
    assert carried_parts(absent, encoder_from=absent) == ({}, {})
    tensors, entries = carried_parts(absent)  # a new gate still gets the encoder its heads were fitted on
    assert set(entries) == {ADAPTERS_KEY} and all(name.startswith("encoder") for name in tensors)


def test_engine_only_replaces_the_engine_head_and_keeps_the_rest_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine-only` over a copy of the shipped gate, with small stand-in features and answer
    states (SmolLM2's take minutes): every tensor and manifest entry but the engine head's, its
    version and its training record is the shipped gate's."""
    out = tmp_path / "gate.safetensors"
    shutil.copy(DEFAULT_GATE, out)
    shutil.copy(manifest_path_for(DEFAULT_GATE), manifest_path_for(out))
    generator = torch.Generator().manual_seed(0)
    examples = [
        Example(f"harmful {i}", CATEGORIES[i % len(CATEGORIES)], "prompt", "pyrit/adv_bench")
        for i in range(60)
    ]
    examples += [Example(f"benign {i}", BENIGN, "prompt", "sharegpt") for i in range(60)]
    examples += [Example(f"held {i}", "crime", "prompt", "pyrit/objective/privacy") for i in range(10)]
    calib = [Example(f"calibration {i}", BENIGN, "prompt", "benign_gsm8k_train") for i in range(200)]

    def features(head: str, rows: list[Example], cache_dir: Path) -> torch.Tensor:
        assert head == ENGINE_HEAD
        harmful = torch.tensor([float(e.label != BENIGN) for e in rows]).reshape(-1, 1)
        return torch.randn(len(rows), 576, generator=generator) + 2 * harmful

    monkeypatch.setattr(train_safety_gate, "cached_features", features)
    monkeypatch.setattr(train_safety_gate, "load_engine_training_replies", lambda wheels: [])
    answers = [Example(f"answer {i}", BENIGN, "output", "benign_medquad_long") for i in range(100)]
    monkeypatch.setattr(train_safety_gate, "calib_benign_outputs", lambda examples, wheels: answers)
    monkeypatch.setattr(
        train_safety_gate,
        "engine_step_states",
        lambda rows: [torch.randn(20, 576, generator=generator) for _ in rows],
    )
    args = argparse.Namespace(
        out=out,
        version="test.1",
        wheels=tmp_path,
        target_fpr=0.01,
        weight_decays=[0.01],
        engine_weight_decays=[0.01],
    )
    train_safety_gate.retrain_engine_head(examples, calib, {}, args)

    shipped, rewritten = load_gate(DEFAULT_GATE), load_gate(out)
    engine_tensors = {f"{ENGINE_HEAD}.weight", f"{ENGINE_HEAD}.bias"}
    assert set(rewritten.tensors) == set(shipped.tensors)
    for name, tensor in shipped.tensors.items():
        assert torch.equal(tensor, rewritten.tensors[name]) != (name in engine_tensors), name
    # the manifest's own hash covers the engine head's entry, so it changes with it by design
    kept = ("format", "sha256", MANIFEST_HASH_KEY, "version", "heads", "training")
    assert {k: v for k, v in shipped.manifest.raw.items() if k not in kept} == {
        k: v for k, v in rewritten.manifest.raw.items() if k not in kept
    }
    assert rewritten.version == "test.1"
    assert rewritten.manifest.raw["heads"][PROMPT_HEAD] == shipped.manifest.raw["heads"][PROMPT_HEAD]
    record = rewritten.manifest.raw["training"]["engine_head"]
    assert record["script"].endswith("--engine-only")
    assert record["threshold"] >= record["threshold_prompts"]  # answers' steps may only raise it
    assert rewritten.head_weights(ENGINE_HEAD).weight.shape == shipped.head_weights(ENGINE_HEAD).weight.shape


def test_the_recorded_commit_says_when_code_differs_from_it(tmp_path: Path, monkeypatch) -> None:
    """A gate trained from uncommitted code names its commit `+dirty`; a rewritten gate file
    alone (the gate tools rewrite it in turn) does not count."""

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "test@example.invalid")
    git("config", "user.name", "test")
    gates = tmp_path / "services" / "safety" / "gates"
    gates.mkdir(parents=True)
    (gates / "gate.json").write_text("{}")
    (tmp_path / "tool.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    monkeypatch.setattr(train_safety_gate, "REPO", tmp_path)
    clean = train_safety_gate.git_commit()
    assert clean and not clean.endswith("+dirty") and clean != "unknown"

    (gates / "gate.json").write_text('{"version": "new"}')
    assert train_safety_gate.git_commit() == clean
    (tmp_path / "tool.py").write_text("x = 2\n")
    assert train_safety_gate.git_commit() == clean + "+dirty"
