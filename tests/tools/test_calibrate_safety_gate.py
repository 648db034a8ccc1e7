"""tools/calibrate_safety_gate.py gives a gate an output head that screens outputs as before."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.gate_file import OUTPUT_HEAD, PROMPT_HEAD, load_gate, write_gate
from services.safety.classifier import HarmScreen
from services.safety.config import DEFAULT_GATE
from tools.calibrate_safety_gate import split_output_head


def test_an_output_head_split_from_a_gate_blocks_what_its_output_screen_blocked(tmp_path: Path) -> None:
    shipped = load_gate(DEFAULT_GATE)
    entry, tensors = split_output_head(shipped)
    manifest = {k: v for k, v in shipped.manifest.raw.items() if k not in ("format", "sha256")}
    manifest["heads"] = manifest["heads"] | {OUTPUT_HEAD: entry}
    # the prompt head is changed, as a retrain changes it: the output screen must not move with it
    prompt_weight = shipped.tensors[f"{PROMPT_HEAD}.weight"].flip(0)
    path = tmp_path / "gate.safetensors"
    write_gate(path, dict(shipped.tensors) | tensors | {f"{PROMPT_HEAD}.weight": prompt_weight}, manifest)
    split = load_gate(path)

    before, after = HarmScreen.of(shipped, "output"), HarmScreen.of(split, "output")
    assert (before.head_name, after.head_name) == (shipped_output_head_name(shipped), OUTPUT_HEAD)
    assert after.thresholds == before.thresholds and after.aggregation == before.aggregation
    generator = torch.Generator().manual_seed(0)
    views = [torch.nn.functional.normalize(torch.randn(5, 384, generator=generator), dim=1) for _ in range(3)]
    assert torch.equal(after.text_scores(views), before.text_scores(views))
    # the prompt screen reads the changed prompt head
    assert not torch.equal(HarmScreen.of(split, "prompt").head.weight, before.head.weight)


def shipped_output_head_name(gate) -> str:
    """The head that screens the committed gate's outputs: its output head once it has one."""
    return OUTPUT_HEAD if OUTPUT_HEAD in gate.manifest.heads else PROMPT_HEAD
