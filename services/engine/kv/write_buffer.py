"""The host memory that cold-tier writes hold on their way to the kvstore, bounded in bytes.

A write job holds host copies of its blocks (a prefill chunk's prompt blocks can be hundreds of
MB) from the step that queues it until its put returns. Against a frozen store a put takes its
whole transfer deadline, so a bound in jobs alone lets the queue grow to hundreds of GB; this
bounds it in bytes. A write that does not fit is dropped by the caller: the cold tier is a cache.
"""

from __future__ import annotations

import threading


class WriteBuffer:
    """Bytes held by writes queued or in flight; `take` (engine thread) and `give_back` (writer
    thread) change it, under a lock.

    One write is always taken when none is held, however large: a bound below one prefill chunk's
    blocks would otherwise drop every prompt store, while the chunk was on the device anyway.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """Bytes held now."""
        return self._num_bytes

    def take(self, num_bytes: int) -> bool:
        """Hold `num_bytes` for a write if they fit (or nothing is held); False: drop the write."""
        with self._lock:
            if self._num_bytes and self._num_bytes + num_bytes > self.max_bytes:
                return False
            self._num_bytes += num_bytes
            return True

    def give_back(self, num_bytes: int) -> None:
        """A write is done (stored, refused or failed): its bytes are free."""
        with self._lock:
            self._num_bytes -= num_bytes

    def describe(self) -> str:
        """For a dropped write's detail: how full the buffer is."""
        held_mib, max_mib = self._num_bytes / 2**20, self.max_bytes / 2**20
        return f"{held_mib:.1f} of {max_mib:g} MiB held by writes waiting for the store"
