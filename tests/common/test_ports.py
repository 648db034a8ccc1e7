"""Ports picked for child processes stay out of the kernel's source-port range."""

from __future__ import annotations

import socket

from services.common.ports import ephemeral_range, free_port


def test_picked_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    low, high = ephemeral_range()
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert not any(low <= port <= high for port in picked)
    with socket.socket() as listener:  # a picked port can be bound
        listener.bind(("127.0.0.1", picked[0]))
