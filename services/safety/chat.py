"""A chat as the prompt screen reads it: its turns, and its turns joined, so that a request split
across messages is read whole. Each join is screened as a prompt of its own beside the turns
(classifier.TextClassifier.score_turns; the deny patterns in screen.Screen.check)."""

from __future__ import annotations

from collections.abc import Sequence

from services.safety.normalizer import MAX_CLAUSE_TEXT_CHARS

# A turn this short may be a piece of a request split across turns. At 4, splits of the held-out
# harmful prompts into 1-4 word turns are all blocked and XSTest's safe questions sent two to a
# chat are blocked no more often than without joins; at 6, 5-word splits are blocked too, but 3 in
# 120 of those chats more (a join of two whole benign questions reads as neither alone).
MAX_FRAGMENT_WORDS = 4


def joined_turns(turns: Sequence[str], roles: Sequence[str] | None = None) -> list[str]:
    """A chat's fragments (turns of at most MAX_FRAGMENT_WORDS words) joined with a space, without
    role labels: those of each run of consecutive turns of one role, of the "user" turns, and of
    every turn past a leading system prompt (the caller names the roles). Each join of two or more
    fragments is screened as a prompt of its own beside the turns, so a request sent a word or two
    per message is read as one sentence. Only fragments: a longer turn is read alone, and whole
    turns joined would cost a window per 48 tokens of the chat; not a leading system prompt, which
    beside a question moves its scores (bench/results/safety_chat_2026-12-06.md). `roles` has one
    role per turn; without them the chat is one run of "user" turns."""
    roles = roles or ["user"] * len(turns)
    runs: list[list[str]] = []
    for at, (role, turn) in enumerate(zip(roles, turns, strict=True)):
        if at == 0 or role != roles[at - 1]:
            runs.append([])
        if _is_fragment(turn):
            runs[-1].append(turn)
    users = [turn for role, turn in zip(roles, turns, strict=True) if role.strip().lower() == "user"]
    # every fragment, whatever its role (the caller names the roles), past a leading system prompt
    start = _num_leading_system(roles)
    everyone = [turn for turn in turns[start:] if _is_fragment(turn)]
    groups = [*runs, [turn for turn in users if _is_fragment(turn)], everyone]
    return list(dict.fromkeys(" ".join(group) for group in groups if len(group) > 1))


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
