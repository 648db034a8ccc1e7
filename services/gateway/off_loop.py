"""Hashing a long prompt on a worker thread, so the event loop goes on serving other calls.

hashlib releases the GIL while it hashes more than 2 KiB, so on a worker thread a digest runs
beside the event loop instead of blocking it: a 512 KiB prompt takes about 1 ms to hash, and an
admitted prompt is hashed twice (its audit digest and its token-count cache key). A short one is
hashed in place, where the thread hand-off would cost more than the hash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
A = TypeVar("A")
MIN_OFF_LOOP_CHARS = 64 * 1024


async def off_loop_when_long(function: Callable[[A], T], argument: A, num_chars: int) -> T:
    """`function(argument)`, on a worker thread when the text it hashes has `MIN_OFF_LOOP_CHARS` or more."""
    if num_chars < MIN_OFF_LOOP_CHARS:
        return function(argument)
    return await asyncio.to_thread(function, argument)
