"""The margin of a chat's joined user-turn windows, chosen on calibration and training data: benign
chats' block rate and split attacks' recall at each margin, then the held-out sets read at the
chosen margin, at 0.25 (the first shipped value) and with the windows off.

    .venv/bin/python bench/safety_chat_joins.py [--margins 0 0.25 0.5 ...] [--out PAGE]

services/safety/chat.py reads consecutive user turns joined in windows (user_windows) whose harm
scores count JOIN_MARGIN_LOGITS lower. Every chat here goes through the service's entry,
Screen.check(rendered, turns=..., roles=...) (gate, attack heads, deny patterns, language), its
turns all "user" turns, rendered as the gateway renders a chat. The margin is set for a run by
patching the value classifier.py imported from chat.py; "windows off" patches chat.user_windows to
return none, which leaves the fragment joins on (the screen before the windows came).

1. Choice (calibration and training sources only, tools/safety_data.SOURCE_SPLITS):
   - benign chats: texts of one calibration source (CALIBRATION_SOURCES) two or three to a chat,
     disjoint groups in sha256 order;
   - split attacks: training harm_* requests of 8-30 words sent 5, 6, 7 and 8 words a message.
   The shipped margin is the smallest of `--margins` at which the benign chats' block rate is at
   most `--max-fpr-added` points over their block rate with the windows off.
2. Report (held out, read after the choice, choosing nothing): XSTest's safe questions two to a
   chat, NQ-open questions two to a chat, and the 5-8 word splits of the 8 held-out requests of
   tests/safety/heldout_prompts.json and the 12 of tests/safety/test_categories.py.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import services.safety.chat as chat_module
import services.safety.classifier as classifier_module
from bench.machine import REPO, cpu_name, git_commit
from services.safety.chat import JOIN_MARGIN_LOGITS
from services.safety.config import SafetyConfig
from services.safety.screen import Screen
from tools.safety_data import CALIB, SOURCE_SPLITS, TEST, TRAIN, data_records, read_data_source

# The short benign prompts of CALIBRATION_FILES (the long documents and the code are left out: a
# turn past 32 words gives the windows only its edges, and chats of them are not questions in a row).
CALIBRATION_SOURCES = (
    "benign_handmade_sensitive",
    "benign_handmade_pairs_calib",
    "benign_handmade_identity",
    "benign_medquad_questions",
    "benign_gsm8k_train",
)
# The training sources of short harmful requests (not PAIR's rewrites: role-play frames of 80 words).
ATTACK_SOURCES = (
    "harm_ailuminate",
    "harm_catqa",
    "harm_gptfuzz_questions",
    "harm_jbb_goals",
    "harm_simplesafetytests",
    "harm_trustllm_privacy",
)
PIECE_WORDS = (5, 6, 7, 8)
MIN_REQUEST_WORDS, MAX_REQUEST_WORDS = 8, 30
FIRST_MARGIN = 0.25  # e364cd4's value, read on the held-out sets beside the chosen one
WINDOWS_OFF = None  # a setting: the user-turn windows off, the fragment joins on


class Chat(NamedTuple):
    """A chat of user turns, and the source its texts came from."""

    turns: tuple[str, ...]
    source: str
    request: str = ""  # a split attack's request, whole

    @property
    def rendered(self) -> str:
        """As the gateway renders a chat for the safety service."""
        return "\n".join(f"user: {turn}" for turn in self.turns)


class Readings(NamedTuple):
    """Which chats of one set are blocked, per setting (a margin in logits, or WINDOWS_OFF)."""

    name: str
    chats: list[Chat]
    blocked: dict[float | None, list[bool]]

    def count(self, setting: float | None) -> int:
        """Chats blocked at `setting`."""
        return sum(self.blocked[setting])

    def subset(self, keep: Sequence[bool]) -> Readings:
        """The chats where `keep` is set."""
        at = [i for i, is_kept in enumerate(keep) if is_kept]
        chosen = {value: [blocked[i] for i in at] for value, blocked in self.blocked.items()}
        return Readings(self.name, [self.chats[i] for i in at], chosen)

    def cell(self, setting: float | None) -> str:
        """`setting`'s block rate and count."""
        count = self.count(setting)
        return f"{100 * count / len(self.chats):.1f}% ({count}/{len(self.chats)})"


def by_hash(texts: Sequence[str], salt: str = "") -> list[str]:
    """`texts` in order of the sha256 of `salt` + each: a fixed order that no source's own has."""
    return sorted(texts, key=lambda text: hashlib.sha256((salt + text).encode()).hexdigest())


def groups_of(texts: Sequence[str], size: int, count: int) -> list[tuple[str, ...]]:
    """Up to `count` disjoint groups of `size` texts, consecutive in sha256 order (salted by size)."""
    ordered = by_hash(texts, f"{size}:")
    return [tuple(ordered[at : at + size]) for at in range(0, len(ordered) - size + 1, size)][:count]


def split_request(request: str, num_words: int) -> tuple[str, ...]:
    """`request` sent `num_words` words per message (test_classifier's _split)."""
    words = request.split()
    return tuple(" ".join(words[at : at + num_words]) for at in range(0, len(words), num_words))


def splits_of(requests: Sequence[str], source: str) -> list[Chat]:
    """Each request sent 5, 6, 7 and 8 words a message, where that makes two messages or more."""
    chats = [
        Chat(split_request(request, size), source, request) for request in requests for size in PIECE_WORDS
    ]
    return [chat for chat in chats if len(chat.turns) > 1]


def calibration_chats(num_pairs: int, num_triples: int) -> list[Chat]:
    """Benign chats: texts of one calibration source two and three to a chat."""
    chats = []
    for source in _in_role(CALIBRATION_SOURCES, CALIB):
        texts = list(dict.fromkeys(read_data_source(source)))
        for size, count in ((2, num_pairs), (3, num_triples)):
            chats += [Chat(group, source) for group in groups_of(texts, size, count)]
    return chats


def training_attacks(per_source: int) -> list[Chat]:
    """Split attacks: up to `per_source` short harmful requests of each training source, split."""
    chats = []
    for source in _in_role(ATTACK_SOURCES, TRAIN):
        records = data_records(source)
        harmful = [r["text"] for r in records if r["kind"] == "prompt" and r["label"] != "benign"]
        short = [t for t in harmful if MIN_REQUEST_WORDS <= len(t.split()) <= MAX_REQUEST_WORDS]
        chats += splits_of(by_hash(list(dict.fromkeys(short)))[:per_source], source)
    return chats


def heldout_sets() -> dict[str, list[Chat]]:
    """The held-out report sets, as e364cd4 measured them (pairs in sha256 order here)."""
    from tests.safety.test_categories import HARMFUL  # the 12 category test requests

    heldout = json.loads((REPO / "tests/safety/heldout_prompts.json").read_text())["harmful"]
    category = [request for requests in HARMFUL.values() for request in requests]
    pair_sources = {"benign_xstest_safe": 125, "benign_nq_open": 120}
    sets = {
        f"{source} pairs": [Chat(g, source) for g in groups_of(read_data_source(source), 2, count)]
        for source, count in pair_sources.items()
        if _in_role([source], TEST)
    }
    sets["test requests split 5-8 words"] = splits_of(heldout, "heldout") + splits_of(category, "categories")
    return sets


def _in_role(sources: Iterable[str], role: str) -> list[str]:
    """`sources`, after checking that each is in `role` (SOURCE_SPLITS)."""
    wrong = [source for source in sources if SOURCE_SPLITS[source] != role]
    if wrong:
        raise ValueError(f"not {role} sources in SOURCE_SPLITS: {wrong}")
    return list(sources)


@contextmanager
def setting(value: float | None) -> Iterator[None]:
    """The screen at one margin (logits), or with the user-turn windows off (WINDOWS_OFF)."""
    if value is WINDOWS_OFF:
        with mock.patch.object(chat_module, "user_windows", lambda turns, roles: []):
            yield
    else:
        with mock.patch.object(classifier_module, "JOIN_MARGIN_LOGITS", value):
            yield


def is_blocked(screen: Screen, chat: Chat) -> bool:
    """The service's verdict on `chat` (Screen.check with its turns and their roles)."""
    return screen.check(chat.rendered, turns=chat.turns, roles=["user"] * len(chat.turns)).is_blocked


def read(screen: Screen, name: str, chats: list[Chat], settings: Sequence[float | None]) -> Readings:
    """Every chat's verdict at every setting (the embedder's cache makes the later settings cheap)."""
    blocked: dict[float | None, list[bool]] = {value: [] for value in settings}
    for at, chat in enumerate(chats):
        for value in settings:
            with setting(value):
                blocked[value].append(is_blocked(screen, chat))
        if (at + 1) % 100 == 0:
            print(f"  {name}: {at + 1}/{len(chats)}", file=sys.stderr, flush=True)
    return Readings(name, chats, blocked)


def blocked_whole(screen: Screen, chats: list[Chat]) -> list[bool]:
    """Whether each split attack's request is blocked sent whole, as one prompt."""
    verdicts = {
        request: screen.check(request).is_blocked for request in dict.fromkeys(c.request for c in chats)
    }
    return [verdicts[chat.request] for chat in chats]


def chosen_margin(benign: Readings, margins: Sequence[float], max_added_points: float) -> float | None:
    """The smallest margin whose windows add at most `max_added_points` to the benign block rate."""
    base = benign.count(WINDOWS_OFF)
    for margin in sorted(margins):
        if 100 * (benign.count(margin) - base) / len(benign.chats) <= max_added_points:
            return margin
    return None


def choice_table(
    benign: Readings, attacks: Readings, whole: Sequence[bool], margins: Sequence[float]
) -> list[str]:
    """Per margin: the benign chats' block rate and what the windows add, and the attacks' recall
    (of all splits, and of the splits of requests blocked when sent whole)."""
    base, blockable = benign.count(WINDOWS_OFF), attacks.subset(whole)
    lines = [
        "| setting | benign calibration chats blocked | added by the windows (points) "
        "| training split attacks blocked | of those whose request is blocked whole |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for value in [WINDOWS_OFF, *margins]:
        added = 100 * (benign.count(value) - base) / len(benign.chats)
        cells = [benign.cell(value), f"{added:+.2f}", attacks.cell(value), blockable.cell(value)]
        lines.append(f"| {_setting_name(value)} | {' | '.join(cells)} |")
    return lines


def by_source_table(readings: Readings, settings: Sequence[float | None]) -> list[str]:
    """Block rates per source of the chats' texts (and chat size), per setting."""
    names = [_setting_name(value) for value in settings]
    lines = [f"| source | chats | {' | '.join(names)} |", "| --- | ---: |" + " ---: |" * len(names)]
    keys = dict.fromkeys((chat.source, len(chat.turns)) for chat in readings.chats)
    for source, size in keys:
        at = [i for i, c in enumerate(readings.chats) if (c.source, len(c.turns)) == (source, size)]
        counts = [sum(readings.blocked[value][i] for i in at) for value in settings]
        cells = " | ".join(f"{100 * n / len(at):.1f}% ({n})" for n in counts)
        lines.append(f"| {source}, {size} turns | {len(at)} | {cells} |")
    return lines


def window_only_blocks(benign: Readings, margin: float) -> list[str]:
    """The benign chats blocked at `margin` and not with the windows off (calibration data)."""
    off, on = benign.blocked[WINDOWS_OFF], benign.blocked[margin]
    chats = [c for c, was, now in zip(benign.chats, off, on, strict=True) if now and not was]
    return [f"- {chat.source}: " + " / ".join(repr(turn) for turn in chat.turns) for chat in chats]


def heldout_table(sets: list[Readings], settings: Sequence[float | None]) -> list[str]:
    """The held-out sets' block rates at the report settings."""
    names = [_setting_name(value) for value in settings]
    lines = [f"| held-out set | rate | {' | '.join(names)} |", "| --- | --- |" + " ---: |" * len(names)]
    for readings in sets:
        rate = "recall" if readings.name.startswith("test requests") else "FPR"
        lines.append(f"| {readings.name} | {rate} | {' | '.join(readings.cell(v) for v in settings)} |")
    return lines


def _setting_name(value: float | None) -> str:
    return "windows off" if value is WINDOWS_OFF else f"margin {value:g}"


def header(args: argparse.Namespace, screen: Screen) -> list[str]:
    """Date, commit, machine and settings of the run."""
    margins = " ".join(f"{m:g}" for m in args.margins)
    return [
        f"- date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit "
        f"{git_commit('services/safety', 'bench/safety_chat_joins.py')}",
        f"- hardware: {cpu_name()}, {platform.machine()}, {os.cpu_count()} cores (shared), load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        f"- command: `.venv/bin/python bench/safety_chat_joins.py --margins {margins} --pairs {args.pairs} "
        f"--triples {args.triples} --attacks-per-source {args.attacks_per_source} "
        f"--max-fpr-added {args.max_fpr_added:g}`",
        f"- gate {screen.gate.version}; chat.py's JOIN_MARGIN_LOGITS at the run: {JOIN_MARGIN_LOGITS:g}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--margins", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0])
    parser.add_argument("--pairs", type=int, default=150, help="benign pairs per calibration source")
    parser.add_argument("--triples", type=int, default=100, help="benign triples per calibration source")
    parser.add_argument("--attacks-per-source", type=int, default=40, help="requests per training source")
    parser.add_argument("--max-fpr-added", type=float, default=1.0, help="points the windows may add")
    parser.add_argument("--out", type=Path, help="write the tables here as well")
    args = parser.parse_args()
    screen = Screen.load(SafetyConfig.from_env({}))
    lines = header(args, screen)
    print("\n".join(lines), flush=True)
    settings = [WINDOWS_OFF, *args.margins]
    benign = read(screen, "calibration", calibration_chats(args.pairs, args.triples), settings)
    attacks = read(screen, "training", training_attacks(args.attacks_per_source), settings)
    whole = blocked_whole(screen, attacks.chats)
    margin = chosen_margin(benign, args.margins, args.max_fpr_added)
    choice = choice_table(benign, attacks, whole, args.margins)
    lines += _section("Choice: calibration and training chats", choice)
    lines += _section("Benign calibration chats by source", by_source_table(benign, settings))
    lines += _section("Training split attacks by source", by_source_table(attacks, settings))
    if margin is None:
        lines += ["", f"No margin of {args.margins} adds at most {args.max_fpr_added:g} points."]
        print("\n".join(lines[4:]), flush=True)
        return
    lines += [
        "",
        f"Chosen margin: {margin:g} logits (smallest adding at most {args.max_fpr_added:g} points).",
    ]
    only_windows = window_only_blocks(benign, margin)
    lines += _section(f"Benign calibration chats only the windows block at {margin:g}", only_windows)
    report = [WINDOWS_OFF, FIRST_MARGIN, margin] if margin != FIRST_MARGIN else [WINDOWS_OFF, margin]
    held = [read(screen, name, chats, report) for name, chats in heldout_sets().items()]
    lines += _section("Held out, read after the choice", heldout_table(held, report))
    print("\n".join(lines[4:]), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def _section(title: str, body: list[str]) -> list[str]:
    return ["", f"### {title}", "", *(body or ["(none)"])]


if __name__ == "__main__":
    main()
