"""tools/train_safety_gate.py rewrites the gate's category heads and keeps what other tools trained."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.gate_file import load_gate, write_gate
from services.safety.attack_head import ATTACK_HEADS, AttackHead
from services.safety.config import DEFAULT_GATE
from services.safety.encoder_adapters import ADAPTERS_KEY, EncoderAdapters
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
