"""Tokenizing off the event loop, on two pools of threads: Generate's, and a smaller one for CountTokens.

Tokenizing is CPU-bound (a megabyte of text takes about half a second) and the tokenizer lets the GIL
go, so it runs on worker threads while the loop serves streams, GetStats and health checks. The
loop's default pool served both RPCs, first come first served: a flood of large counts took every
thread, and a 3-token Generate waited 30 s behind it. Now CountTokens has a pool of its own, a
quarter of the cores: counts queue there, and take neither Generate's threads nor every core. A
call that goes away drops its work if it is still queued; a thread already tokenizing finishes.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_Result = TypeVar("_Result")

NUM_CPUS = os.cpu_count() or 1
NUM_GENERATE_THREADS = min(32, NUM_CPUS + 4)  # what the loop's default pool has
NUM_COUNT_THREADS = max(1, NUM_CPUS // 4)

_generate_pool = ThreadPoolExecutor(NUM_GENERATE_THREADS, thread_name_prefix="tokenize-generate")
_count_pool = ThreadPoolExecutor(NUM_COUNT_THREADS, thread_name_prefix="tokenize-count")


async def for_generate(call: Callable[..., _Result], *args: object) -> _Result:
    """`call(*args)` on Generate's pool."""
    return await _run(_generate_pool, call, *args)


async def for_count(call: Callable[..., _Result], *args: object) -> _Result:
    """`call(*args)` on CountTokens' pool."""
    return await _run(_count_pool, call, *args)


async def _run(pool: ThreadPoolExecutor, call: Callable[..., _Result], *args: object) -> _Result:
    """As `asyncio.to_thread`, on `pool`: the call sees this task's context (its trace span)."""
    bound = functools.partial(contextvars.copy_context().run, call, *args)
    return await asyncio.get_running_loop().run_in_executor(pool, bound)
