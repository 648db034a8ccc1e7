"""Deny patterns against every labelled text we have: how often each policy file matches, per source.

    .venv/bin/python bench/safety_deny_patterns.py services/safety/deny_patterns.txt [other.txt ...]

Every source of tools/safety_data.py (the wheels' harm data and ShareGPT, and every data/safety file,
whatever its split) is screened whole by each policy file, as the safety service applies it (every
view of the text). A benign source's rate is a false-positive rate, a harmful one's a recall; the
split column says which sources a pattern could have been written against (none is read here to
choose one). Prints one markdown table and, for benign sources, every matching text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.safety.policy import DenyPatternPolicy
from tools.safety_data import (
    BENIGN,
    DATA_DIR,
    LABELLED_FILES,
    SOURCE_SPLITS,
    fetch_wheels,
    labelled_data_source,
    load_benign_outputs,
    load_examples,
    read_data_source,
)


def labelled_texts(wheels: Path) -> dict[str, tuple[bool, list[str]]]:
    """source -> (is benign, texts): the wheels' examples by source and label side, and every
    data/safety file (labelled files split by label, the others by their name)."""
    paths = fetch_wheels(wheels)
    examples = load_examples(paths)
    sources: dict[str, tuple[bool, list[str]]] = {}
    grouped: dict[tuple[str, bool], list[str]] = defaultdict(list)
    for e in [*examples, *load_benign_outputs(paths, examples)]:
        grouped[(e.source, e.label == BENIGN)].append(e.text)
    for (source, benign), texts in grouped.items():
        sources[f"{source}{' (benign)' if benign else ''}"] = (benign, texts)
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        name = path.stem
        if name in LABELLED_FILES:
            continue  # already read through load_examples
        first = json.loads(path.read_text().split("\n", 1)[0])
        if "label" in first:  # a labelled file outside LABELLED_FILES (the held-out toxic text)
            rows = labelled_data_source(name)
            sources[name] = (False, [t for t, label in rows if label != BENIGN])
            sources[f"{name} (benign)"] = (True, [t for t, label in rows if label == BENIGN])
        else:
            sources[name] = (name.startswith("benign"), read_data_source(name))
    return {k: v for k, v in sources.items() if v[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("policies", type=Path, nargs="+", help="deny-pattern files to compare")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    args = parser.parse_args()
    policies = [DenyPatternPolicy.load(p) for p in args.policies]
    sources = labelled_texts(args.wheels)
    named = zip(args.policies, policies, strict=True)
    header = " | ".join(f"`{path.name}` {policy.version[-12:]}" for path, policy in named)
    print(f"| source | split | side | texts | {header} |")
    print("| --- | --- | --- | ---: |" + " ---: |" * len(policies))
    benign_hits: list[tuple[str, str, str]] = []
    for name, (benign, texts) in sorted(sources.items(), key=lambda kv: (kv[1][0], kv[0])):
        base = name.removesuffix(" (benign)")
        split = SOURCE_SPLITS.get(base, SOURCE_SPLITS.get(base.split("/responses")[0], "?"))
        cells = []
        for path, policy in zip(args.policies, policies, strict=True):
            hits = [t for t in texts if policy.check(t).is_blocked]
            cells.append(f"{len(hits)} ({100 * len(hits) / len(texts):.1f}%)")
            if benign:
                benign_hits += [(path.name, name, t) for t in hits]
        side = "benign (FPR)" if benign else "harmful (recall)"
        print(f"| {name} | {split} | {side} | {len(texts)} | " + " | ".join(cells) + " |")
    print(f"\n{len(benign_hits)} benign matches")
    for policy_name, source, text in benign_hits:
        print(f"- {policy_name}, {source}: {text[:200]!r}")


if __name__ == "__main__":
    main()
