"""Nearest neighbours in the gate's embedding space as a harm score, beside the shipped linear head.

    .venv/bin/python bench/safety_knn_probe.py --k 1,3,8,16,32

A question about the representation (issue 13, point 2): does the shipped encoder's space hold more
than its linear head reads? Every text is cut into windows as the service cuts them
(tools/train_jailbreak_head.py's `embed_views`, cached beside the training features). Scorers:

- linear: the shipped prompt head's largest logit margin over its thresholds (harm categories,
  its window aggregation; bench/safety_gates_compare.py's `margins`);
- knn: per window, the mean cosine similarity to its k nearest training harmful windows minus that
  to its k nearest training benign windows (the prompt head's training rows: the training split's
  prompts and the contrast frames), the largest over the text's windows;
- sum: both, each standardised on the calibration benign texts, added.

Each scorer gets one threshold, the 99th percentile of its scores on the pooled calibration benign
files (tools/safety_data.CALIBRATION_FILES), so the columns compare rankings at one simple rule; the
shipped gate's own per-category, per-source calibration is not reproduced, and its figures differ.
The choice among scorers and k is to be made on the calibration rows (the calibration split's
harmful prompts, first row); the held-out rows are for reporting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.safety_gates_compare import RANKED_PAIRS, held_out_sets, margins
from bench.safety_heldout import roc_auc
from services.common.gate_file import load_gate
from services.safety.config import DEFAULT_GATE
from tools.safety_data import (
    BENIGN,
    CALIB,
    CALIBRATION_FILES,
    TRAIN,
    contrast_examples,
    fetch_wheels,
    load_examples,
    read_data_source,
)
from tools.train_jailbreak_head import embed_views

Views = list[list[torch.Tensor]]


def window_bank(views: Views) -> torch.Tensor:
    """[N, E]: every window of every text, unit length."""
    return F.normalize(torch.cat([torch.cat(text) for text in views]).float(), dim=-1)


def knn_margins(views: Views, harmful: torch.Tensor, benign: torch.Tensor, k: int) -> torch.Tensor:
    """[T]: per text, the largest over its windows of (mean top-k cosine to `harmful`) - (to `benign`)."""
    out = []
    for text in views:
        rows = F.normalize(torch.cat(text).float(), dim=-1)
        near_harm = (rows @ harmful.T).topk(min(k, len(harmful)), dim=1).values.mean(1)
        near_benign = (rows @ benign.T).topk(min(k, len(benign)), dim=1).values.mean(1)
        out.append((near_harm - near_benign).max())
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--k", default="8", help="neighbours to average, comma-separated")
    args = parser.parse_args()
    cache = args.wheels / "features"
    gate = load_gate(DEFAULT_GATE)
    examples = load_examples(fetch_wheels(args.wheels))
    train = [e for e in examples if e.split == TRAIN and e.kind == "prompt"]
    harmful = window_bank(embed_views([e.text for e in train if e.label != BENIGN], cache).views_of())
    benign_texts = [e.text for e in train if e.label == BENIGN] + [e.text for e in contrast_examples()]
    benign = window_bank(embed_views(benign_texts, cache).views_of())
    calib_harmful = [
        e.text for e in examples if e.split == CALIB and e.kind == "prompt" and e.label != BENIGN
    ]
    held_out, _ = held_out_sets(args.wheels)
    sets = {"calibration harmful (recall)": calib_harmful}
    sets |= {f"calibration {name} (FPR)": read_data_source(name) for name in CALIBRATION_FILES}
    sets |= held_out
    views = {name: embed_views(texts, cache).views_of() for name, texts in sets.items()}
    linear = {name: margins(v, gate) for name, v in views.items()}
    calib_names = [f"calibration {name} (FPR)" for name in CALIBRATION_FILES]
    for k in (int(x) for x in args.k.split(",")):
        knn = {name: knn_margins(v, harmful, benign, k) for name, v in views.items()}
        pooled_linear = torch.cat([linear[n] for n in calib_names])
        pooled_knn = torch.cat([knn[n] for n in calib_names])

        def scorers(name: str) -> dict[str, torch.Tensor]:
            standard_linear = (linear[name] - pooled_linear.mean()) / pooled_linear.std()  # noqa: B023
            standard_knn = (knn[name] - pooled_knn.mean()) / pooled_knn.std()  # noqa: B023
            return {"linear": linear[name], "knn": knn[name], "sum": standard_linear + standard_knn}  # noqa: B023

        pooled = {s: torch.cat([scorers(n)[s] for n in calib_names]) for s in ("linear", "knn", "sum")}
        thresholds = {s: torch.quantile(v, 0.99) for s, v in pooled.items()}
        print(f"\n### k = {k}\n")
        print("| set (rate: recall or FPR), % | linear | knn | sum |\n| --- | ---: | ---: | ---: |")
        for name in sets:
            cells = [f"{100 * (scorers(name)[s] > t).float().mean():.1f}" for s, t in thresholds.items()]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print("\n| held-out pair, AUC | linear | knn | sum |\n| --- | ---: | ---: | ---: |")
        for positive, negatives in RANKED_PAIRS:
            cells = []
            for s in thresholds:
                pos = scorers(positive)[s]
                neg = torch.cat([scorers(n)[s] for n in negatives])
                cells.append(f"{roc_auc(pos, neg):.3f}")
            pair = (
                positive.removesuffix(" (recall)")
                + " vs "
                + " + ".join(n.removesuffix(" (FPR)") for n in negatives)
            )
            print(f"| {pair} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
