"""How a chat's turns are joined for the screen (services/safety/chat.py); what the joins block is
in test_classifier.py."""

from __future__ import annotations

from services.safety.chat import (
    JOIN_EDGE_WORDS,
    JOIN_WINDOW_WORDS,
    MAX_TURNS_PER_PACK,
    fragment_joins,
    joined_turns,
    packed_turns,
    turn_roles,
    user_windows,
)
from services.safety.normalizer import MAX_CLAUSE_TEXT_CHARS


def test_fragments_are_joined_by_role_run_by_user_turns_and_past_a_leading_system_prompt() -> None:
    chat = [("system", "Be brief."), ("user", "how do"), ("assistant", "ok"), ("x", "I make"),
            ("user", "a pipe"), ("user", "bomb"), ("assistant", "A long answer of more words.")]  # fmt: skip
    whole = "\n".join(f"{role}: {content}" for role, content in chat)
    turns = [content for _, content in chat]
    roles = [role for role, _ in chat]
    assert turn_roles(turns, whole) == roles
    fragments = ["a pipe bomb", "how do a pipe bomb", "how do ok I make a pipe bomb"]
    assert fragment_joins(turns, roles) == fragments
    assert joined_turns(turns, roles)[:3] == fragments  # then the user turns' windows
    assert turn_roles(turns, "not the rendering") is None
    assert "Be brief. how do ok I make a pipe bomb" in joined_turns(turns)  # no roles: one run


def test_user_turns_are_read_in_windows_across_turns_a_long_turn_by_its_edges() -> None:
    long_turn = " ".join(f"w{i}" for i in range(100))
    chat = [("system", "Be brief and careful."), ("user", "one two three four five six"),
            ("assistant", "A reply that is left out."), ("user", "seven eight nine ten eleven"),
            ("user", long_turn), ("user", "twelve thirteen")]  # fmt: skip
    turns, roles = [c for _, c in chat], [r for r, _ in chat]
    head, tail = " ".join(long_turn.split()[:JOIN_EDGE_WORDS]), " ".join(long_turn.split()[-JOIN_EDGE_WORDS:])
    assert user_windows(turns, roles) == [
        f"one two three four five six seven eight nine ten eleven {head}",
        f"{tail} twelve thirteen",  # nothing runs across the long turn's middle
    ]
    assert user_windows(["a long turn alone, with nothing to join it to"], ["user"]) == []


def test_every_run_of_user_turns_of_half_a_window_lies_whole_in_one_and_the_windows_are_bounded() -> None:
    turns = [" ".join(f"t{n}w{i}" for i in range(6)) for n in range(40)]  # 6 words each
    roles = ["user"] * len(turns)
    windows = user_windows(turns, roles)
    assert all(len(w.split()) <= JOIN_WINDOW_WORDS for w in windows)
    assert len(windows) < len(turns)  # fewer rows than the turns cost alone
    per_run = JOIN_WINDOW_WORDS // 2 // 6  # turns in half a window
    for first in range(len(turns) - per_run + 1):
        run = " ".join(turns[first : first + per_run])
        assert any(run in window for window in windows), first


def test_turns_are_packed_a_line_each_past_a_leading_system_prompt_and_a_long_turn_stays_alone() -> None:
    long_turn = "word " * (MAX_CLAUSE_TEXT_CHARS // 5 + 1)
    turns = ["Be brief.", "a", "b", "c", long_turn, "d", "e"]
    roles = ["system", "user", "assistant", "user", "user", "assistant", "user"]
    assert packed_turns(turns, roles, 1) == turns
    assert packed_turns(turns, roles, 2) == ["Be brief.", "a\nb", "c", long_turn, "d\ne"]
    assert packed_turns(turns, roles, MAX_TURNS_PER_PACK) == ["Be brief.", "a\nb\nc", long_turn, "d\ne"]
    assert packed_turns(turns, None, 3) == ["Be brief.\na\nb", "c", long_turn, "d\ne"]  # no roles: all users'
