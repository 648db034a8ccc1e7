"""Tokenizing off the event loop, on two pools of threads: Generate's, and a smaller one for CountTokens.

Tokenizing is CPU-bound (a megabyte of text takes about half a second) and the tokenizer lets the GIL
go, so it runs on worker threads while the loop serves streams, GetStats and health checks. The
loop's default pool served both RPCs, first come first served: a flood of large counts took every
thread, and a 3-token Generate waited 30 s behind it. Now CountTokens has a pool of its own, a
quarter of the cores: counts queue there, and take neither Generate's threads nor every core. A
call that goes away drops its work if it is still queued; a thread already tokenizing finishes.

The counts' queue is bounded (`CountQueue`): each queued count holds its text (up to a megabyte of
characters), and a client could queue millions of them. Generate needs no such bound here: its
requests are bounded by the context, and the engine's own queue and intent classes pace them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.common.errors import ResourceExhausted

_Result = TypeVar("_Result")

NUM_CPUS = os.cpu_count() or 1
NUM_GENERATE_THREADS = min(32, NUM_CPUS + 4)  # what the loop's default pool has
NUM_COUNT_THREADS = max(1, NUM_CPUS // 4)

_generate_pool = ThreadPoolExecutor(NUM_GENERATE_THREADS, thread_name_prefix="tokenize-generate")
_count_pool = ThreadPoolExecutor(NUM_COUNT_THREADS, thread_name_prefix="tokenize-count")


async def for_generate(call: Callable[..., _Result], *args: object) -> _Result:
    """`call(*args)` on Generate's pool."""
    return await _run(_generate_pool, call, *args)


class CountQueue:
    """The CountTokens calls waiting for their pool or running on it, at most `max_counts`.

    `run` changes `num_counts`; it runs on the event loop only, so a plain count needs no lock. A
    call that goes away stops counting at once, even while a thread still finishes its work: at most
    the pool's threads run beyond the bound.
    """

    def __init__(self, max_counts: int) -> None:
        self.max_counts = max_counts
        self.num_counts = 0

    def can_queue(self) -> bool:
        """Whether one more count may queue."""
        return self.num_counts < self.max_counts

    async def run(self, call: Callable[..., _Result], *args: object) -> _Result:
        """`call(*args)` on CountTokens' pool; RESOURCE_EXHAUSTED when the queue is full."""
        if not self.can_queue():
            raise ResourceExhausted(
                f"this engine already has {self.max_counts} CountTokens calls queued or running, its "
                "limit (THERMOCLINE_ENGINE_MAX_QUEUED_COUNTS); retry once some have finished, or raise "
                "the setting"
            )
        self.num_counts += 1
        try:
            return await _run(_count_pool, call, *args)
        finally:
            self.num_counts -= 1


async def _run(pool: ThreadPoolExecutor, call: Callable[..., _Result], *args: object) -> _Result:
    """As `asyncio.to_thread`, on `pool`: the call sees this task's context (its trace span)."""
    bound = functools.partial(contextvars.copy_context().run, call, *args)
    return await asyncio.get_running_loop().run_in_executor(pool, bound)
