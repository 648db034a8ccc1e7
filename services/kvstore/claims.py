"""Which put in flight writes which key, and how another put of that key learns how it ended.

One key gets one record: a rebuild keeps the last record of a key in the files, which must be the
one the index serves. So from a put's `append` of a key to its commit the key is claimed, and
another put that names it writes nothing then. That put waits, after committing its own records,
for the claim to settle: True when the claiming put committed the block (durable and indexed: a
duplicate), False when it failed or its caller went away (the waiting put then writes the block
itself). A duplicate therefore always means durable now.

A put never waits while it holds a claim (its own records are committed and their claims settled
first), so two puts that name the same keys in opposite orders cannot wait on each other.

The compactor claims a key too, while it copies the key's tombstone forward (and settles it as
failed: the block is absent), so a put of that key writes its record after the copy; a tombstone
copied after a newer record would delete the block at the next rebuild.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import NamedTuple

from services.kvstore.blocks import BlockIn
from services.kvstore.keys import Namespace, StoreKey
from services.kvstore.results import PendingWrite, PutResult

Outcome = asyncio.Future[bool]  # a claimed key's: True once durable and indexed, False if its put failed


class BlockWait(NamedTuple):
    """A block that another put was writing when this put reached it; written again if that put fails."""

    namespace: Namespace
    block: BlockIn
    outcome: Outcome


@dataclass
class PutInFlight:
    """One put between its first append and its commit: the keys it has claimed and not yet
    settled, the records awaiting their commit, the blocks waiting on other puts (payloads held
    until then), what it has stored or found present so far, and, while a record of it is being
    written, the segment that was active when that write began (the record lands there or later)."""

    appending_from: int | None = None
    claimed: set[StoreKey] = field(default_factory=set)
    pending: list[PendingWrite] = field(default_factory=list)
    waits: list[BlockWait] = field(default_factory=list)
    result: PutResult = field(default_factory=PutResult)


class KeyClaims:
    """The keys puts in flight are writing, each with its outcome. Mutators: claim, settle, settle_all."""

    def __init__(self) -> None:
        self._outcomes: dict[StoreKey, Outcome] = {}

    def outcome(self, key: StoreKey) -> Outcome | None:
        """The outcome of the put writing `key`; None when no put is."""
        return self._outcomes.get(key)

    def claim(self, put: PutInFlight, key: StoreKey) -> None:
        """`put` writes `key` until it settles it."""
        assert key not in self._outcomes, "a claimed key was claimed again"
        self._outcomes[key] = asyncio.get_running_loop().create_future()
        put.claimed.add(key)

    def settle(self, put: PutInFlight, key: StoreKey, is_durable: bool) -> None:
        """Ends `put`'s claim on `key`; its waiters learn whether the block is durable."""
        put.claimed.remove(key)
        outcome = self._outcomes.pop(key)
        if not outcome.done():
            outcome.set_result(is_durable)

    def settle_all(self, put: PutInFlight, is_durable: bool) -> None:
        """Ends every claim `put` still holds."""
        for key in list(put.claimed):
            self.settle(put, key, is_durable)


async def wait_outcomes(waits: list[BlockWait]) -> list[bool]:
    """Whether each block's other put committed it, once every one of those puts has ended.
    A cancelled waiter leaves the outcomes as they are (`asyncio.wait` never cancels them)."""
    if waits:
        await asyncio.wait({w.outcome for w in waits})
    return [not w.outcome.cancelled() and w.outcome.result() for w in waits]
