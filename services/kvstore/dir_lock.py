"""The data dir's lock: one kvstore process per data dir.

Two processes over one dir each take the other's active segment for a sealed one: the newcomer's
compactor deletes the segment the other still appends to, which then acknowledges puts into an
unlinked file, and each rotates into ids the other created. So a store holds an exclusive
`fcntl.flock` on `<data dir>/LOCK` for its life, taken before it reads or writes anything there.
The kernel drops the lock when the process dies, however it dies, so a crash leaves none behind.
The file names its holder (pid and host), for the message a second process gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = "LOCK"


class DataDirLocked(Exception):
    """Another process holds the data dir."""


class DataDirLock:
    """An exclusive lock on a data dir, held until `release` (or the process's end)."""

    def __init__(self, descriptor: int, path: Path) -> None:
        self._descriptor: int | None = descriptor
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Takes the lock at once; DataDirLocked, naming the holder, when another process has it."""
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # segments, secret: the store's user only
        path = data_dir / LOCK_NAME
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise DataDirLocked(
                f"the kvstore data dir {data_dir} is in use by another kvstore process ({holder}); "
                "one process serves one data dir: stop that one first, or give this one its own "
                "THERMOCLINE_KVSTORE_DATA_DIR"
            ) from None
        with contextlib.suppress(OSError):  # the name is for messages only (the disk may be full)
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return cls(descriptor, path)

    def release(self) -> None:
        """Lets another process take the data dir."""
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the file drops its flock
            self._descriptor = None
