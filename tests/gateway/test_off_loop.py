"""A long prompt is hashed on a worker thread, beside the event loop; a short one in place."""

from __future__ import annotations

import asyncio
import threading

from services.gateway.audit import prompt_sha256
from services.gateway.off_loop import MIN_OFF_LOOP_CHARS, off_loop_when_long


def _thread_of(_: object) -> int:
    return threading.get_ident()


def test_long_text_is_hashed_on_a_worker_thread_and_short_text_on_the_loop() -> None:
    async def threads() -> tuple[int, int, int]:
        on_loop = threading.get_ident()
        long = await off_loop_when_long(_thread_of, None, MIN_OFF_LOOP_CHARS)
        short = await off_loop_when_long(_thread_of, None, MIN_OFF_LOOP_CHARS - 1)
        return on_loop, long, short

    on_loop, long, short = asyncio.run(threads())
    assert long != on_loop and short == on_loop


def test_the_digest_is_the_same_on_either_side() -> None:
    text = "é" * MIN_OFF_LOOP_CHARS
    assert asyncio.run(off_loop_when_long(prompt_sha256, text, len(text))) == prompt_sha256(text)
