"""What the restatement views (services/safety/restate.py) block: harmful requests rewritten into
the past or the future tense, and every benign source they might block by mistake.

    .venv/bin/python bench/safety_restate.py [--out bench/results/safety_restate_<date>.md]

Each text is checked by the whole screen (gate, attack heads, deny patterns, language; the
shipped thresholds) twice in one process: with the restatements (harm views of the classifier
and forms the deny patterns read) and without them. A text
with no restatement scores the same both ways, so the benign rows check only the texts that have
one and report the blocks they add.

Attacks: JailbreakBench's behaviours rewritten by GPT-3.5 into the past and the future tense
(data/safety/attack_{past,future}_tense.jsonl, tools/build_tense_data.py), read per behaviour
whose plain goal the screen blocks: a rewrite of a behaviour the screen does not block as written
(a category it has no head for, or a miss) says nothing about the rewrite. The rules were written
against the past-tense rewrites of the even-numbered behaviours; the odd ones and every
future-tense rewrite are held out from that work, and each is a row of its own. A third set,
data/safety/attack_handmade_tense.jsonl, rewrites held-out requests the screen blocks (HarmBench,
Do-Not-Answer, PyRIT, XSTest); benign_handmade_tense.jsonl asks harmless questions in the same
forms.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.machine import cpu_name, git_commit
from bench.safety_deny_patterns import labelled_texts
from bench.safety_eval import percentile_ms
from services.safety import classifier, policy
from services.safety.config import SafetyConfig
from services.safety.normalizer import canonical
from services.safety.restate import restatements
from services.safety.screen import Screen
from tools.safety_data import SOURCE_SPLITS, data_records

TENSE_SOURCES = ("attack_past_tense", "attack_future_tense", "attack_handmade_tense")
# Sources of answers, not prompts: the restatements are for prompts only.
_OUTPUT_SOURCE_MARKS = ("responses", "replies", "outputs", "/refusal", "safe answers")


def checker(screen: Screen, restating: bool) -> Callable[[str], bool]:
    """Whether the screen blocks a prompt, with the restatement views or without them."""

    def blocked(text: str) -> bool:
        if restating:
            return screen.check(text).is_blocked
        with (
            mock.patch.object(classifier, "prompt_restatements", lambda readings: []),
            mock.patch.object(policy, "prompt_restatements", lambda readings: []),
        ):
            return screen.check(text).is_blocked

    return blocked


def percent(count: int, total: int) -> str:
    return f"{100 * count / total:.1f}% ({count}/{total})" if total else "-"


def tense_rows(screen: Screen) -> list[str]:
    """Per tense and behaviour half: the rewrites blocked without and with restatements."""
    before, after = checker(screen, False), checker(screen, True)
    rows = []
    goals: dict[int, str] = {}
    for source in TENSE_SOURCES[:2]:
        for record in data_records(source):
            goals.setdefault(int(record["behaviour"]), record["request"])
    goal_blocked = {index: before(goal) for index, goal in goals.items()}
    rows.append(
        f"| JailbreakBench goals as written (a training source) | all | {len(goals)} | "
        f"{percent(sum(goal_blocked.values()), len(goals))} | same |"
    )
    for source in TENSE_SOURCES[:2]:
        records = [r for r in data_records(source) if goal_blocked[int(r["behaviour"])]]
        for half, parity in (("even (the rules' development set)", 0), ("odd (held out)", 1)):
            texts = [r["text"] for r in records if int(r["behaviour"]) % 2 == parity]
            if source == "attack_future_tense":
                half = half.split(" (")[0] + " (held out)"
            was = sum(map(before, texts))
            now = sum(map(after, texts))
            rates = f"{percent(was, len(texts))} | {percent(now, len(texts))}"
            rows.append(f"| {source} | {half} | {len(texts)} | {rates} |")
    handmade = data_records("attack_handmade_tense")  # each a rewrite of a request blocked as written
    for style in ("past", "future", "third_person"):
        texts = [r["text"] for r in handmade if r["style"] == style]
        rates = (
            f"{percent(sum(map(before, texts)), len(texts))} | {percent(sum(map(after, texts)), len(texts))}"
        )
        rows.append(f"| attack_handmade_tense | {style.replace('_', ' ')} | {len(texts)} | {rates} |")
    return rows


def added_rows(
    screen: Screen, sources: dict[str, tuple[bool, list[str]]], benign: bool
) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """Per prompt source of one side: texts, texts restated, blocks added; and the added blocks."""
    before, after = checker(screen, False), checker(screen, True)
    rows, added = [], []
    for name, (is_benign, texts) in sorted(sources.items()):
        if is_benign != benign or name in TENSE_SOURCES or any(mark in name for mark in _OUTPUT_SOURCE_MARKS):
            continue
        restated = [t for t in texts if restatements(canonical(t))]
        new = [t for t in restated if after(t) and not before(t)]
        role = SOURCE_SPLITS.get(name.removesuffix(" (benign)"), "-")
        rows.append(f"| {name} | {role} | {len(texts)} | {len(restated)} | {percent(len(new), len(texts))} |")
        added += [(name, t, restatements(canonical(t))) for t in new]
    return rows, added


def latency_rows(screen: Screen) -> list[str]:
    """Screen.check p50 / p99 on past-tense rewrites, without and with restatements."""
    texts = [r["text"] for r in data_records("attack_past_tense")][:100]
    rows = []
    for restating in (False, True):
        check = checker(screen, restating)
        check(texts[0])
        seconds = []
        for text in texts:
            start = time.perf_counter()
            check(text)
            seconds.append(time.perf_counter() - start)
        p50, p99 = percentile_ms(seconds, 50), percentile_ms(seconds, 99)
        rows.append(f"| {'with' if restating else 'without'} | {p50:.1f} | {p99:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path, help="write the page here as well")
    args = parser.parse_args()
    screen = Screen.load(SafetyConfig.from_env({}))
    lines = [
        f"- date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {git_commit()}",
        f"- hardware: {cpu_name()}, {platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        "- command: `.venv/bin/python bench/safety_restate.py`",
        "",
        "## Harmful requests rewritten into another tense (rewrites of behaviours blocked as written)",
        "",
        "| source | behaviours | rewrites | blocked without restatements | with |",
        "| --- | --- | ---: | ---: | ---: |",
        *tense_rows(screen),
    ]
    print("\n".join(lines), flush=True)
    sources = labelled_texts(args.wheels)
    rows, added = added_rows(screen, sources, benign=True)
    harmful_rows, _ = added_rows(screen, sources, benign=False)
    benign = [
        "",
        "## Benign prompts: blocks the restatements add",
        "",
        "| source | role | prompts | restated | blocks added |",
        "| --- | --- | ---: | ---: | ---: |",
        *rows,
        "",
        "Every added block:",
        "",
        *(f"- {name}: {text!r} -> {restated!r}" for name, text, restated in added),
        "",
        "## Harmful prompts of every other source: blocks the restatements add",
        "",
        "| source | role | prompts | restated | blocks added |",
        "| --- | --- | ---: | ---: | ---: |",
        *harmful_rows,
        "",
        "## Time of one check (100 past-tense rewrites, ms)",
        "",
        "| restatements | p50 | p99 |",
        "| --- | ---: | ---: |",
        *latency_rows(screen),
    ]
    print("\n".join(benign), flush=True)
    if args.out:
        args.out.write_text("\n".join([*lines, *benign]) + "\n")


if __name__ == "__main__":
    main()
