"""The RAM staging cache: records that a prefetch loaded ahead of their read, bounded in bytes.

An `OrderedDict` in LRU order (moved to the end on each hit, evicted from the front) gives O(1)
hits and evictions. A key being loaded has a future in `loading`, so a read that arrives while
its prefetch is in flight waits for that load instead of reading the disk a second time.

A load is its future: `drop` (a delete, an eviction, an expiry) ends the key's load in flight, and
`end_load` stages a record only for the load still in flight, so a read that returns after its key
was dropped stages nothing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from services.kvstore.keys import StoreKey
from services.kvstore.record import Record

Load = asyncio.Future[Record | None]  # a prefetch's read of one record; None: absent, corrupt or dropped


class StagingCache:
    """Staged records and in-flight loads. Mutators: put, drop, begin_load, end_load."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._records: OrderedDict[StoreKey, Record] = OrderedDict()
        self.loading: dict[StoreKey, Load] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: StoreKey) -> bool:
        return key in self._records

    def get(self, key: StoreKey) -> Record | None:
        """The staged record, moved to most recently used; None when not staged."""
        found = self._records.get(key)
        if found is not None:
            self._records.move_to_end(key)
        return found

    def can_stage(self, record: Record) -> bool:
        """Whether the record fits the budget at all."""
        return len(record.payload) <= self.max_bytes

    def put(self, key: StoreKey, record: Record) -> None:
        """Stages a record, evicting the least recently used ones to make room."""
        if not self.can_stage(record):
            return
        self._unstage(key)
        while self._records and self.num_bytes + len(record.payload) > self.max_bytes:
            _, evicted = self._records.popitem(last=False)
            self.num_bytes -= len(evicted.payload)
        self._records[key] = record
        self.num_bytes += len(record.payload)

    def drop(self, key: StoreKey) -> None:
        """Unstages a key (deleted, evicted or corrupt on disk) and ends its load in flight, if any:
        that load's waiters get None, and its record is not staged when the read returns."""
        self._unstage(key)
        load = self.loading.pop(key, None)
        if load is not None and not load.done():
            load.set_result(None)

    def _unstage(self, key: StoreKey) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.num_bytes -= len(record.payload)

    def begin_load(self, key: StoreKey) -> Load | None:
        """Marks a load in flight and returns it; None when the key is staged or loading already."""
        if key in self._records or key in self.loading:
            return None
        load: Load = asyncio.get_running_loop().create_future()
        self.loading[key] = load
        return load

    def end_load(self, key: StoreKey, load: Load, record: Record | None) -> None:
        """Finishes a load: stages the record (None: it was absent or corrupt) and wakes its waiters;
        nothing when the key was dropped since the load began."""
        if self.loading.get(key) is not load:
            return  # dropped: its waiters got None then
        del self.loading[key]
        if record is not None:
            self.put(key, record)
        load.set_result(record)
