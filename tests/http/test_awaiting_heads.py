"""services/gateway/http/awaiting_heads.py: which waiting connection makes room, oldest first and
per host, on plain strings for connections (no sockets)."""

from __future__ import annotations

from services.gateway.http.awaiting_heads import AwaitingHeads


def _waiting(max_per_host: int, *pairs: tuple[str, str]) -> AwaitingHeads[str]:
    """An AwaitingHeads holding each (connection, host) of `pairs`, added in that order."""
    heads: AwaitingHeads[str] = AwaitingHeads(max_per_host)
    for connection, host in pairs:
        heads.add(connection, host)
    return heads


def test_a_host_at_its_cap_or_unknown_has_none_over_it() -> None:
    heads = _waiting(2, ("a1", "10.0.0.1"), ("a2", "10.0.0.1"))
    assert heads.oldest_over_host_cap("10.0.0.1") is None
    assert heads.oldest_over_host_cap("10.0.0.2") is None


def test_a_host_past_its_cap_gives_its_oldest_not_anothers() -> None:
    heads = _waiting(2, ("b1", "10.0.0.2"), ("a1", "10.0.0.1"), ("a2", "10.0.0.1"), ("a3", "10.0.0.1"))
    assert heads.oldest_over_host_cap("10.0.0.1") == "a1"
    heads.discard("a1")
    assert heads.oldest_over_host_cap("10.0.0.1") is None


def test_a_host_whose_connections_all_left_is_forgotten() -> None:
    heads = _waiting(0, ("a1", "10.0.0.1"))
    assert heads.oldest_over_host_cap("10.0.0.1") == "a1"
    heads.discard("a1")
    heads.discard("a1")  # a second discard of the same connection is a no-op
    assert heads.oldest_over_host_cap("10.0.0.1") is None
    assert len(heads) == 0 and "a1" not in heads


def test_the_oldest_overall_skips_the_one_asking() -> None:
    heads = _waiting(8, ("a1", "10.0.0.1"), ("b1", "10.0.0.2"))
    assert heads.oldest(other_than="a1") == "b1"
    assert heads.oldest(other_than="b1") == "a1"
    assert _waiting(8, ("a1", "10.0.0.1")).oldest(other_than="a1") is None
