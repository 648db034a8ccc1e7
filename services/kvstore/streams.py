"""The block streams a kvstore serves at once (PutBlocks, GetBlocks), and how long a put may idle.

Each stream holds payload in memory while it runs: a put buffers a block's chunks (up to
`max_block_bytes`, 64 MiB by default, and about three times that while it is joined and
checked), and a get reads records ahead of a client that may read slowly. Without a bound, N
stalled clients take N times that, until the process runs out of memory. So at most
`max_streams` run at once, and one more is refused with RESOURCE_EXHAUSTED (a caller's cue to
back off, as the engine does for any failed call). A put stream that sends nothing for
`stream_idle_s` is ended, so a hung client frees its slot and its memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

from services.common.errors import DeadlineExceeded, ResourceExhausted
from services.kvstore import kvstore_metrics as metrics

T = TypeVar("T")


class StreamSlots:
    """Counts the open block streams and refuses one past `max_streams`. Mutator: `open`."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.num_open = 0

    @contextlib.contextmanager
    def open(self, rpc: str) -> Iterator[None]:
        """Holds a slot for one stream of `rpc` ("put", "get"); RESOURCE_EXHAUSTED if none is free."""
        if self.num_open >= self.max_streams:
            metrics.STREAMS_REFUSED.labels(rpc).inc()
            raise ResourceExhausted(
                f"the kvstore is serving {self.num_open} block streams, its limit "
                "(THERMOCLINE_KVSTORE_MAX_STREAMS); nothing was done: retry after a backoff, or "
                "raise the limit if the store has memory to spare"
            )
        self.num_open += 1
        metrics.OPEN_STREAMS.labels(rpc).inc()
        try:
            yield
        finally:
            self.num_open -= 1
            metrics.OPEN_STREAMS.labels(rpc).dec()


async def within_idle_limit(messages: AsyncIterator[T], idle_s: float, rpc: str) -> AsyncIterator[T]:
    """`messages`, ended with DEADLINE_EXCEEDED when the next one takes longer than `idle_s`."""
    iterator = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"{rpc}: no message for {idle_s:g} s (THERMOCLINE_KVSTORE_STREAM_IDLE_S), so the store "
                "ended the stream; nothing it carried was acknowledged: send a put's messages without "
                "pausing, and retry"
            ) from None
        yield message
