"""Picking a loopback port for a process that binds it later (a test mesh, a TP rendezvous).

Asking the kernel for port 0 and closing the socket hands back a port from the ephemeral range,
the same range the kernel draws from for every outgoing connection. Between the pick and the
child's bind, any client on the machine (a Redis PING, a health-check channel) may take that
port as its source port, and the child fails with "Address already in use". So the ports
picked here come from below the ephemeral range, which the kernel never assigns on its own;
each is probed with a bind, and one process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, used where /proc does not say
_FLOOR = 20000  # below this sit the well-known defaults of many servers
_MIN_CANDIDATES = 1000
_ATTEMPTS = 200

_handed_out: set[int] = set()
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections."""
    try:
        low, high = _EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_pick() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now and that no outgoing connection will
    take as its source port; never the same one twice in this process."""
    low, high = ephemeral_range()
    if low - _FLOOR >= _MIN_CANDIDATES:
        candidates = range(_FLOOR, low)
    elif 65535 - high >= _MIN_CANDIDATES:
        candidates = range(high + 1, 65536)
    else:  # the ephemeral range covers nearly every port: nothing safer than the kernel's pick
        candidates = range(0)
    for _ in range(_ATTEMPTS if candidates else 0):
        port = _random.choice(candidates)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    port = _kernel_pick()
    _handed_out.add(port)
    return port
