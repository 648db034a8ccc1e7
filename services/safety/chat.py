"""A chat as the prompt screen reads it: its turns, and its turns joined, so that a request split
across messages is read whole. Each join is screened as a prompt of its own beside the turns
(classifier.TextClassifier.score_turns; the deny patterns in screen.Screen.check)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from services.safety.normalizer import MAX_CLAUSE_TEXT_CHARS

# A turn this short may be a piece of a request split across turns. At 4, splits of the held-out
# harmful prompts into 1-4 word turns are all blocked and XSTest's safe questions sent two to a
# chat are blocked no more often than without joins; at 6, 5-word splits are blocked too, but 3 in
# 120 of those chats more (a join of two whole benign questions reads as neither alone).
MAX_FRAGMENT_WORDS = 4


# Consecutive turns are read joined too, whatever their length, so that a request split into
# pieces longer than fragments is read whole: the user turns with the other roles' turns left out
# (user_windows: pieces between which the assistant replied), and all the turns whatever their
# roles (turn_windows: the model reads every turn, and in an OpenAI-style API the caller writes the
# system, assistant and tool turns too; a role the screen does not know is a turn like any other).
# A window holds JOIN_WINDOW_WORDS words of its turns and one starts every half window, so any run
# of consecutive turns of up to half a window in all (32 words: most requests) lies whole in one. A
# turn longer than 2 * JOIN_EDGE_WORDS words gives the windows only its first and last
# JOIN_EDGE_WORDS, where a piece of a request split between it and its neighbours would be (the
# turn is screened whole on its own). The bound: a window must hold the boundary between two turns,
# and each turn gives at most 2 * JOIN_EDGE_WORDS = half a window of words, so each set of windows
# is fewer than the turns it reads, each of at most JOIN_WINDOW_WORDS words (one row, unless its
# words are unusually long): a chat of user turns alone has one set (the two coincide) and fewer
# windows than turns; any chat has fewer than its turns and its user turns together, and about one
# per 32 words of text when the turns are short. With other roles between the user turns that is
# up to 1.5 windows a turn, not under one: a chat of 32-word turns, user and assistant in turn,
# needs a window for every two adjacent turns and another for every two user turns.
JOIN_WINDOW_WORDS = 64
JOIN_EDGE_WORDS = 16
# A window across whole turns reads two prompts or more as one, which the thresholds were not
# calibrated on, and two benign questions joined can read as neither does alone ("How can I not
# bomb the test at school?" and "What should I do to hit my targets?": violence 0.9695 against a
# threshold of 0.967). So a window's harm scores count this many logits lower. Chosen on
# calibration and training data alone (bench/safety_chat_joins.py,
# bench/results/safety_chat_joins_2026-12-07.md): the smallest margin at which the windows add at
# most 1 point to the block rate of 916 benign chats of two or three calibration prompts (+0.76 at
# 1.0, +1.31 at 0.75, +2.95 at 0.25). At 1.0 the windows block 74.0% of 955 5-8 word splits of
# training harm requests (53.5% without them, 79.6% at 0.25). Read after the choice, XSTest's safe
# questions two to a chat: 38 of 125 blocked (30 without windows, 45 at 0.25); the 5-8 word splits
# of the held-out and category test requests: 70 of 76 (59, 76).
JOIN_MARGIN_LOGITS = 1.0
# The windows across turns of every role that are not also user windows (turn_windows: a system
# prompt, a reply or a tool's answer read beside a question) count this many logits lower. Chosen by
# the same rule on training and calibration chats alone (bench/safety_chat_roles.py,
# bench/results/safety_chat_roles_2026-12-07.md): the smallest margin at which they add at most 1
# point to the block rate of 615 benign chats (60 ShareGPT training conversations with a system
# prompt, 185 calibration pairs with a system prompt and a reply between, 370 calibration questions
# after a system prompt): +0.49 points at 1.0 (3 chats), +0.33 at 1.5. At 1.0 they block 93.6% of
# 376 training requests split 5-8 words between a user turn and another role's (68.6% without
# them, 90.4% at 1.5).
ROLE_JOIN_MARGIN_LOGITS = 1.0


class Joins(NamedTuple):
    """What a chat's turns joined are screened as, beside the turns: its fragments joined
    (fragment_joins); the windows across its user turns that are not one of those (user_windows),
    whose harm scores count JOIN_MARGIN_LOGITS lower; and the windows across all its turns that
    are neither (turn_windows), which count ROLE_JOIN_MARGIN_LOGITS lower."""

    fragments: list[str]
    windows: list[str]
    role_windows: list[str]

    @property
    def texts(self) -> list[str]:
        """Every join: the fragments', then the user windows, then the windows across roles."""
        return [*self.fragments, *self.windows, *self.role_windows]


def joins_of(turns: Sequence[str], roles: Sequence[str] | None = None) -> Joins:
    """The chat's joins, each once. `roles` has one role per turn; without them every turn is a
    user's."""
    roles = roles or ["user"] * len(turns)
    fragments = fragment_joins(turns, roles)
    windows = [window for window in dict.fromkeys(user_windows(turns, roles)) if window not in fragments]
    role_windows = [
        window
        for window in dict.fromkeys(turn_windows(turns))
        if window not in fragments and window not in windows
    ]
    return Joins(fragments, windows, role_windows)


def joined_turns(turns: Sequence[str], roles: Sequence[str] | None = None) -> list[str]:
    """Every join of the chat's turns (joins_of), as texts."""
    return joins_of(turns, roles).texts


def fragment_joins(turns: Sequence[str], roles: Sequence[str]) -> list[str]:
    """A chat's fragments (turns of at most MAX_FRAGMENT_WORDS words) joined with a space, without
    role labels: those of each run of consecutive turns of one role, of the "user" turns, and of
    every turn past a leading system prompt (the caller names the roles). Each join of two or more
    fragments is screened as a prompt of its own beside the turns, so a request sent a word or two
    per message is read as one sentence, also between longer turns or in turns of any role. Not a
    leading system prompt, which beside a question moves its scores
    (bench/results/safety_chat_2026-12-06.md): turn_windows read it, at the windows' margin."""
    runs: list[list[str]] = []
    for at, (role, turn) in enumerate(zip(roles, turns, strict=True)):
        if at == 0 or role != roles[at - 1]:
            runs.append([])
        if _is_fragment(turn):
            runs[-1].append(turn)
    users = [turn for role, turn in zip(roles, turns, strict=True) if _is_user(role)]
    # every fragment, whatever its role (the caller names the roles), past a leading system prompt
    start = _num_leading_system(roles)
    everyone = [turn for turn in turns[start:] if _is_fragment(turn)]
    groups = [*runs, [turn for turn in users if _is_fragment(turn)], everyone]
    return list(dict.fromkeys(" ".join(group) for group in groups if len(group) > 1))


def user_windows(turns: Sequence[str], roles: Sequence[str]) -> list[str]:
    """Windows over the words of a chat's user turns in order, the other roles' turns left out
    (_windows_over), so that a request split across user turns is read whole however long the
    replies between its pieces."""
    return _windows_over(
        [(n, turn) for n, (role, turn) in enumerate(zip(roles, turns, strict=True)) if _is_user(role)]
    )


def turn_windows(turns: Sequence[str]) -> list[str]:
    """Windows over the words of all a chat's turns in order, whatever their roles (a leading system
    prompt, the assistant's, a tool's, a role the screen does not know), built as user_windows
    are: the model reads every turn, and the caller writes every one of them."""
    return _windows_over(list(enumerate(turns)))


def _windows_over(turns: Sequence[tuple[int, str]]) -> list[str]:
    """Windows over the words of `turns` (turn number, text) in order, each joined with a space:
    JOIN_WINDOW_WORDS words, one starting every half window, and only those that hold a boundary
    between two turns (inside one turn, a window reads nothing the turn alone does not). A turn
    past 2 * JOIN_EDGE_WORDS words gives its first and last JOIN_EDGE_WORDS, and no window runs
    across its middle."""
    segments: list[list[tuple[int, str]]] = [[]]  # (turn number, word), cut inside long turns
    for number, turn in turns:
        words = [(number, word) for word in turn.split()]
        if len(words) <= 2 * JOIN_EDGE_WORDS:
            segments[-1] += words
        else:
            segments[-1] += words[:JOIN_EDGE_WORDS]
            segments.append(words[-JOIN_EDGE_WORDS:])
    return [window for segment in segments for window in _windows_across_turns(segment)]


def _windows_across_turns(words: list[tuple[int, str]]) -> list[str]:
    """The windows of `words` (turn number, word) that hold words of two turns or more."""
    windows = []
    for start in range(0, len(words), JOIN_WINDOW_WORDS // 2):
        window = words[start : start + JOIN_WINDOW_WORDS]
        if window[0][0] != window[-1][0]:
            windows.append(" ".join(word for _, word in window))
        if start + JOIN_WINDOW_WORDS >= len(words):
            break
    return windows


def _is_user(role: str) -> bool:
    return role.strip().lower() == "user"


def _is_fragment(turn: str) -> bool:
    return 0 < len(turn.split()) <= MAX_FRAGMENT_WORDS


def _num_leading_system(roles: Sequence[str]) -> int:
    """1 when the chat opens with a system prompt, else 0."""
    return 1 if roles and roles[0].strip().lower() == "system" else 0


# A chat whose turns and joins need more rows than the screen embeds per check (its max_windows)
# has its turns screened packed: up to this many consecutive turns to a text, each on a line of its
# own, in a text short enough to be read clause by clause (normalizer.MAX_CLAUSE_TEXT_CHARS), so
# that each packed turn of normalizer.MIN_CLAUSE_WORDS words or more is still embedded alone as
# well, as a clause of the pack (classifier.extra_rows); the fewer a pack holds, the less a short
# harmful turn is diluted by its neighbours.
MAX_TURNS_PER_PACK = 8


def packed_turns(turns: Sequence[str], roles: Sequence[str] | None, per_pack: int) -> list[str]:
    """`turns` with consecutive ones past a leading system prompt joined a line each, up to
    `per_pack` to a text of at most MAX_CLAUSE_TEXT_CHARS characters; a longer turn, and a leading
    system prompt (which beside a question moves its scores), stay alone. per_pack 1: the turns."""
    start = _num_leading_system(roles or [])
    packs = [[turn] for turn in turns[:start]]
    for turn in turns[start:]:
        last = packs[-1] if len(packs) > start else []
        if 0 < len(last) < per_pack and len("\n".join([*last, turn])) <= MAX_CLAUSE_TEXT_CHARS:
            last.append(turn)
        else:
            packs.append([turn])
    return ["\n".join(pack) for pack in packs]


def turn_roles(turns: Sequence[str], whole: str | None) -> list[str] | None:
    """Each turn's role, read off `whole` where it is the turns rendered as the gateway renders a
    chat ("role: content" lines, gateway/gatekeeper.prompt_text); else None. Only for a caller
    that sends no roles (a gateway that predates CheckPromptRequest.roles): a caller renders
    `text` as it likes, and a role it names is the one that counts."""
    if whole is None:
        return None
    roles: list[str] = []
    at = 0
    for number, turn in enumerate(turns, 1):
        line = ": " + turn + ("\n" if number < len(turns) else "")
        colon = whole.find(": ", at)
        while colon >= 0 and not whole.startswith(line, colon):
            colon = whole.find(": ", colon + 1)
        if colon < 0:
            return None
        roles.append(whole[at:colon])
        at = colon + len(line)
    return roles if at == len(whole) else None
