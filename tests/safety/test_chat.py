"""How a chat's turns are joined for the screen (services/safety/chat.py); what the joins block is
in test_classifier.py."""

from __future__ import annotations

from services.safety.chat import (
    JOIN_EDGE_WORDS,
    JOIN_WINDOW_WORDS,
    MAX_TURNS_PER_PACK,
    fragment_joins,
    joined_turns,
    joins_of,
    packed_turns,
    turn_roles,
    turn_windows,
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


def test_turns_of_every_role_are_read_in_windows_too_a_leading_system_prompt_and_unknown_roles() -> None:
    long_reply = " ".join(f"r{i}" for i in range(100))
    chat = [("system", "you are to explain how"), ("user", "one makes a thing at home"),
            ("assistant", long_reply), ("user\u200b", "then seven eight"), ("tool", "nine ten")]  # fmt: skip
    turns, roles = [c for _, c in chat], [r for r, _ in chat]
    head, tail = (
        " ".join(long_reply.split()[:JOIN_EDGE_WORDS]),
        " ".join(long_reply.split()[-JOIN_EDGE_WORDS:]),
    )
    assert turn_windows(turns) == [
        f"you are to explain how one makes a thing at home {head}",
        f"{tail} then seven eight nine ten",
    ]
    assert user_windows(turns, roles) == []  # one turn has the role "user"
    joins = joins_of(turns, roles)
    assert (joins.windows, joins.role_windows) == ([], turn_windows(turns))
    two_users = ["user", "user", "assistant", "user", "user"]  # the user turns alone, then every turn
    joins = joins_of(turns, two_users)
    assert joins.windows == ["you are to explain how one makes a thing at home then seven eight nine ten"]
    assert joins.role_windows == turn_windows(turns)
    assert joins.texts == [*joins.fragments, *joins.windows, *joins.role_windows]


def test_a_chat_of_user_turns_alone_has_the_same_windows_as_before() -> None:
    turns = [" ".join(f"t{n}w{i}" for i in range(6 + n % 30)) for n in range(40)]
    assert turn_windows(turns) == user_windows(turns, ["user"] * len(turns))
    joins = joins_of(turns)
    assert (joins.windows, joins.role_windows) == (user_windows(turns, ["user"] * len(turns)), [])


def test_every_two_adjacent_turns_of_any_roles_lie_whole_in_a_window_and_the_windows_are_bounded() -> None:
    sizes = [3, 40, 16, 32, 33, 1, 100, 20]  # words; past 32 a turn gives its edges
    turns = [" ".join(f"t{n}w{i}" for i in range(size)) for n, size in enumerate(sizes * 5)]
    roles = ["system", "user", "assistant", "tool", "user", "developer", "usr", "user"] * 5
    windows = turn_windows(turns)
    assert all(len(w.split()) <= JOIN_WINDOW_WORDS for w in windows)
    assert len(windows) < len(turns)
    assert len(user_windows(turns, roles)) < roles.count("user")
    for first in range(len(turns) - 1):
        end = " ".join(turns[first].split()[-JOIN_EDGE_WORDS:])
        start = " ".join(turns[first + 1].split()[:JOIN_EDGE_WORDS])
        assert any(f"{end} {start}" in window for window in windows), first
