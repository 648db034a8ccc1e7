"""Tasks that run on after whoever started them has moved on."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")

# The loop keeps only weak references to tasks: one nobody holds may be collected mid-run.
_held: set[asyncio.Future[Any]] = set()


def hold(task: asyncio.Future[T]) -> asyncio.Future[T]:
    """Keeps `task` referenced until it is done; returns it."""
    _held.add(task)
    task.add_done_callback(_held.discard)
    return task
