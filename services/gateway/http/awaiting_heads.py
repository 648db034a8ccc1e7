"""The connections waiting for a request head: oldest first, and counted per client host.

A connection waits for a head from its start, and again after each answer, until its next head is
in (protocol.py arms the head deadline for that time). It is what a client holds without having
sent a request, and so without a token: the stuff a flood of idle sockets is made of. A peer that
reopens each socket the head deadline closes could hold every slot of the connection cap, and
every new connection, a real caller's too, was closed as it opened. So at the cap the connection
that has waited longest makes room, and one host may keep only so many waiting at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Connection = TypeVar("Connection", bound=Hashable)


class AwaitingHeads(Generic[Connection]):
    """The connections that wait for a head, in the order they began to wait, per client host.

    `add` and `discard` change state; the rest only read. OrderedDicts rather than lists: a
    connection leaves from anywhere in the order (its head came, it closed) in O(1), and the
    oldest is the first key."""

    def __init__(self, max_per_host: int) -> None:
        self.max_per_host = max_per_host
        self._hosts: OrderedDict[Connection, str] = OrderedDict()
        self._by_host: dict[str, OrderedDict[Connection, None]] = {}

    def __len__(self) -> int:
        return len(self._hosts)

    def __contains__(self, connection: object) -> bool:
        return connection in self._hosts

    def add(self, connection: Connection, host: str) -> None:
        """`connection`, from `host`, begins to wait for a head (the newest)."""
        self._hosts[connection] = host
        self._by_host.setdefault(host, OrderedDict())[connection] = None

    def discard(self, connection: Connection) -> None:
        """`connection` waits no more: its head came, or it closed."""
        host = self._hosts.pop(connection, None)
        if host is None:
            return
        waiting = self._by_host[host]
        del waiting[connection]
        if not waiting:
            del self._by_host[host]

    def oldest(self, other_than: Connection) -> Connection | None:
        """The connection that has waited longest, other than `other_than`; None when none waits."""
        return next((connection for connection in self._hosts if connection != other_than), None)

    def oldest_over_host_cap(self, host: str) -> Connection | None:
        """The longest waiting connection of `host` while it holds more than `max_per_host`."""
        waiting = self._by_host.get(host)
        if waiting is None or len(waiting) <= self.max_per_host:
            return None
        return next(iter(waiting))
