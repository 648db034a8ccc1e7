"""Giving a gRPC call started just now the event loop before other work of the same turn."""

from __future__ import annotations

import asyncio

# Loop turns from starting a traced gRPC call until its request is on the wire: the caller's
# coroutine creates the call, the client interceptor opens its span, the call sends.
TURNS_TO_SEND = 3


async def let_calls_go_out() -> None:
    """Yields the loop until a call started just now has sent its request, so that the work the
    caller does next (a Redis round trip, the audit write) waits behind it, not the other way."""
    for _ in range(TURNS_TO_SEND):
        await asyncio.sleep(0)
