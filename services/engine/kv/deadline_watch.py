"""One thread that runs a callback when a deadline passes, unless the work it guards ended first.

The cold tier's prefix loads use it: a request held for its stored prefix must stop waiting at its
deadline even when the loader thread is stuck (a transfer that streams slowly, or another load
ahead of it), and the engine, asleep until something is reported, must hear of it then. A heap
and one thread rather than a `threading.Timer` per load: a timer is a thread per request.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import NewType

WatchId = NewType("WatchId", int)


class DeadlineWatch:
    """Calls each `at` callback once its time (`time.monotonic()`) has come, on its own thread.

    `at` and `cancel` change the set of pending callbacks; exactly one of `cancel` and the firing
    takes a callback out, so a callback runs at most once and never after a successful `cancel`.
    """

    def __init__(self, name: str) -> None:
        self._wakeup = threading.Condition()
        self._heap: list[tuple[float, WatchId]] = []
        self._pending: dict[WatchId, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def at(self, deadline_s: float, callback: Callable[[], None]) -> WatchId:
        """Run `callback` at `deadline_s` (monotonic) unless cancelled before."""
        watch_id = WatchId(next(self._ids))
        with self._wakeup:
            self._pending[watch_id] = callback
            heapq.heappush(self._heap, (deadline_s, watch_id))
            self._wakeup.notify()
        return watch_id

    def cancel(self, watch_id: WatchId) -> bool:
        """Drop a pending callback; False when it has run (or is running) already."""
        with self._wakeup:
            return self._pending.pop(watch_id, None) is not None

    @property
    def num_pending(self) -> int:
        """Callbacks neither run nor cancelled."""
        with self._wakeup:
            return len(self._pending)

    def close(self) -> None:
        """Stop the thread; pending callbacks never run."""
        with self._wakeup:
            self._is_closed = True
            self._wakeup.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                callback = self._next_due()
                if callback is None:
                    return
            callback()

    def _next_due(self) -> Callable[[], None] | None:
        """Wait (under the lock) for the earliest pending deadline; its callback, None once closed."""
        while not self._is_closed:
            if not self._heap:
                self._wakeup.wait()
                continue
            deadline_s, watch_id = self._heap[0]
            if watch_id not in self._pending:  # cancelled: forget it
                heapq.heappop(self._heap)
                continue
            left_s = deadline_s - time.monotonic()
            if left_s > 0:
                self._wakeup.wait(left_s)
                continue
            heapq.heappop(self._heap)
            return self._pending.pop(watch_id)
        return None
