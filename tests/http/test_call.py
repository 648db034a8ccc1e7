"""Generation, the HTTP front's servicer stream in a task of its own: a drain's cut that lands while
the task waits to queue a message for a client reading slowly still reaches the stream.

The cut is the gateway's own (InFlightStream.cut); the stream ends it as GatewayServicer.Generate
does, with an error that counts the tokens it yielded. How the mesh's HTTP streams are cut and
audited end to end is tests/gateway/test_drain.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from opentelemetry import trace

from services.common.errors import Unavailable
from services.gateway.http.call import QUEUE_MESSAGES, Generation
from services.gateway.in_flight import InFlightStream
from thermocline.gateway.v1 import gateway_pb2 as pb


class CountingStream:
    """An endless stream of one-token messages that ends a cut with Unavailable naming the tokens
    it yielded; `is_waiting` is set once it has yielded more than the queue holds, so the task's
    write of that last message waits on the client."""

    def __init__(self) -> None:
        self.is_waiting = asyncio.Event()
        self.stream: InFlightStream | None = None

    async def messages(self) -> AsyncGenerator[pb.GenerateResponse, None]:
        task = asyncio.current_task()
        assert task is not None
        self.stream = stream = InFlightStream(task)
        try:
            while True:
                stream.num_tokens += 1
                if stream.num_tokens > QUEUE_MESSAGES:
                    self.is_waiting.set()
                yield pb.GenerateResponse(delta=pb.TextDelta(token_ids=[stream.num_tokens]))
        except asyncio.CancelledError:
            if not stream.is_cut:
                raise
            stream.task.uncancel()
            raise Unavailable(f"cut after {stream.num_tokens} tokens") from None


async def _read_until_error(generation: Generation) -> tuple[list[int], Exception]:
    """The token ids a client reading on gets, then the error that ends the stream."""
    token_ids = []
    while True:
        try:
            # bounded: a stream that was closed instead of cut sends nothing more, ever
            message = await asyncio.wait_for(generation.next(), timeout=10)
        except Unavailable as error:
            return token_ids, error
        assert message is not None, "the stream finished instead of being cut"
        token_ids.extend(message.delta.token_ids)


def test_a_cut_while_a_message_waits_for_a_slow_client_ends_the_stream_with_every_token_counted() -> None:
    async def scenario() -> tuple[list[int], Exception]:
        counting = CountingStream()
        generation = Generation(counting.messages(), trace.INVALID_SPAN, timeout_s=60)
        await counting.is_waiting.wait()  # the queue is full; nothing reads it
        assert counting.stream is not None
        counting.stream.cut()
        return await _read_until_error(generation)

    token_ids, error = asyncio.run(scenario())
    # The message whose write the cut interrupted is counted, and reaches the client before the error.
    num_sent = QUEUE_MESSAGES + 1
    assert token_ids == list(range(1, num_sent + 1))
    assert str(error) == f"cut after {num_sent} tokens"
