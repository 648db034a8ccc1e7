"""LoopMailbox: engine-thread events reach the right asyncio queue, in order, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.engine.scheduling.sequence import RequestId, StreamEvent
from services.engine.serving.servicer import LoopMailbox


def _event(request: str, index: int) -> StreamEvent:
    return StreamEvent(
        request_id=RequestId(request), token_ids=(index,), text_delta=str(index), finished=False,
        finish_reason=None, prompt_tokens=1, completion_tokens=index,
    )  # fmt: skip


def test_a_burst_from_another_thread_arrives_in_order_with_one_delivery() -> None:
    async def scenario() -> tuple[list[int], list[int], int]:
        mailbox = LoopMailbox(asyncio.get_running_loop())
        deliveries = 0
        deliver = mailbox._deliver

        def counted() -> None:
            nonlocal deliveries
            deliveries += 1
            deliver()

        mailbox._deliver = counted  # type: ignore[method-assign]
        first: asyncio.Queue[StreamEvent] = asyncio.Queue()
        second: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def engine_step() -> None:  # one step's events, posted while the loop is busy
            for index in range(100):
                is_first = index % 2 == 0
                mailbox.post(first if is_first else second, _event("a" if is_first else "b", index))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # blocks the loop: every post lands before it can deliver
        got_first = [(await first.get()).token_ids[0] for _ in range(50)]
        got_second = [(await second.get()).token_ids[0] for _ in range(50)]
        return got_first, got_second, deliveries

    got_first, got_second, deliveries = asyncio.run(scenario())
    assert got_first == list(range(0, 100, 2))
    assert got_second == list(range(1, 100, 2))
    assert deliveries == 1


def test_posting_to_a_closed_loop_raises_and_a_new_loop_still_works() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
    loop.close()
    with pytest.raises(RuntimeError):
        mailbox.post(queue, _event("a", 1))
    with pytest.raises(RuntimeError):  # not left believing a delivery is on its way
        mailbox.post(queue, _event("a", 2))
