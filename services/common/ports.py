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


_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def port_holders(port: int) -> list[str]:
    """Who holds local TCP `port` now, one line per socket: its state and, where this process may
    read it, the pid and command line of a process with it open. For the message of a child that
    failed with "Address already in use", so that the next such failure says what took the port.
    Linux only (/proc); elsewhere, or where nothing holds it, an empty list."""
    sockets: list[tuple[str, str]] = []  # (state, inode)
    for table in _TCP_TABLES:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                sockets.append((_TCP_STATES.get(fields[3], fields[3]), fields[9]))
    owners = _socket_owners({inode for _, inode in sockets if inode != "0"})
    return [f"{state} ({owner})" if (owner := owners.get(inode)) else state for state, inode in sockets]


def _socket_owners(inodes: set[str]) -> dict[str, str]:
    """inode -> "pid N: command line" of a process holding that socket open."""
    owners: dict[str, str] = {}
    if not inodes:
        return owners
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # the process ended, or is not ours to read
            continue
        for fd in fds:
            try:  # each fd alone: a busy process (this one, say) closes some while they are read
                target = fd.readlink().name
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    owners.setdefault(target[8:-1], f"pid {proc.name}: {command.strip()[:200]}")
            except OSError:
                continue
    return owners
