"""The adversarial-suffix score (services/safety/suffix.py) over every labelled source: how many
texts reach its threshold per source, benign and attack, and the benign texts that come closest.

The score reads tokens, not embeddings, so this runs in a minute on a CPU:
    .venv/bin/python bench/safety_suffix.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.safety_deny_patterns import labelled_texts
from services.safety.suffix import SUFFIX_THRESHOLD, suffix_score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--closest", type=int, default=8, help="benign texts to list, highest first")
    args = parser.parse_args()
    sources = labelled_texts(args.wheels)
    suffix_score("Load the dictionary the score reads words by before timing it [ [ [ [ [ [")
    print(f"threshold {SUFFIX_THRESHOLD}\n")
    print("| source | role | texts | scored > 0 | at or over the threshold |")
    print("| --- | --- | ---: | ---: | ---: |")
    closest: list[tuple[float, str, str]] = []
    micros: list[float] = []
    totals = {True: [0, 0], False: [0, 0]}
    for name, (benign, texts) in sorted(sources.items()):
        scores = []
        for text in texts:
            start = time.perf_counter()
            scores.append(suffix_score(text))
            micros.append((time.perf_counter() - start) * 1e6)
        hits = sum(s >= SUFFIX_THRESHOLD for s in scores)
        totals[benign][0] += len(texts)
        totals[benign][1] += hits
        if benign:
            closest += [(s, name, t) for s, t in zip(scores, texts, strict=True) if s > 0]
        if hits or any(scores):
            role = "benign" if benign else "attack"
            share = f"{100 * hits / len(texts):.1f}% ({hits})"
            print(f"| {name} | {role} | {len(texts)} | {sum(s > 0 for s in scores)} | {share} |")
    for benign, (count, hits) in totals.items():
        print(f"\n{'benign' if benign else 'attack'} texts in all: {count}, at or over the threshold: {hits}")
    p99 = sorted(micros)[int(0.99 * (len(micros) - 1))]
    p50 = statistics.median(micros)
    print(f"score time per text: p50 {p50:.0f} µs, p99 {p99:.0f} µs, max {max(micros):.0f} µs")
    print("\n| closest benign texts | source | score |\n| --- | --- | ---: |")
    for score, name, text in sorted(closest, reverse=True)[: args.closest]:
        shown = text[-120:].replace("|", "\\|").replace("\n", " ")
        print(f"| …{shown} | {name} | {score:.2f} |")


if __name__ == "__main__":
    main()
