"""Event-loop helpers the servicer and the relay share: giving a gRPC call started just now the
loop before other work of the same turn, and dropping a task whose result nobody will read."""

from __future__ import annotations

import asyncio
from typing import Any

# Loop turns from starting a traced gRPC call until its request is on the wire: the task that
# makes the call starts (its span opens), the call sends; one turn to spare for an intercepted
# call, whose interceptor runs in a task of its own.
TURNS_TO_SEND = 3


async def let_calls_go_out() -> None:
    """Yields the loop until a call started just now has sent its request, so that the work the
    caller does next (a Redis round trip, the audit write) waits behind it, not the other way."""
    for _ in range(TURNS_TO_SEND):
        await asyncio.sleep(0)


def discard(task: asyncio.Future[Any]) -> None:
    """Cancels `task`, or reads the error of one that already failed, so that asyncio does not log
    it as never retrieved."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
