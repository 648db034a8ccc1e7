"""Load shedding: at most `max_streams` Generate streams in flight per gateway process, and at
most a tenant's own `max_streams` of them.

A call beyond the process's cap is refused at once with RESOURCE_EXHAUSTED and pushback metadata,
before any other work, so an overloaded gateway spends nothing on calls it cannot serve; streams
already admitted run to completion. A tenant's cap (its tenants-file entry) is checked once the
caller is authenticated, before its prompt is screened, so one tenant cannot hold every slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from services.common.errors import ResourceExhausted
from services.gateway.metrics import STREAMS_IN_FLIGHT
from services.gateway.rate_limiter import retry_metadata


class StreamSlots:
    """Counts streams in flight against a fixed cap."""

    def __init__(self, max_streams: int, pushback_ms: int) -> None:
        self.max_streams = max_streams
        self.pushback_ms = pushback_ms
        self.num_in_flight = 0

    def can_admit(self) -> bool:
        """Whether one more stream fits under the cap."""
        return self.num_in_flight < self.max_streams

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Holds one slot for the body's duration; RESOURCE_EXHAUSTED when none is free."""
        if not self.can_admit():
            raise ResourceExhausted(
                f"gateway is at its limit of {self.max_streams} concurrent streams; "
                f"retry after {self.pushback_ms} ms or on another replica",
                trailing_metadata=retry_metadata(self.pushback_ms),
            )
        self.num_in_flight += 1
        STREAMS_IN_FLIGHT.inc()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            STREAMS_IN_FLIGHT.dec()


class TenantStreams:
    """Streams in flight per tenant, against each tenant's own cap."""

    def __init__(self, pushback_ms: int) -> None:
        self.pushback_ms = pushback_ms
        self._counts: Counter[str] = Counter()

    def num_in_flight(self, tenant: str) -> int:
        """The tenant's streams holding a slot now."""
        return self._counts[tenant]

    def take(self, tenant: str, max_streams: int) -> None:
        """Takes one of the tenant's slots (0: no cap of its own); RESOURCE_EXHAUSTED when none is
        free. Every take is paired with one `release`."""
        if max_streams and self._counts[tenant] >= max_streams:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {max_streams} streams in flight on this gateway, its limit; "
                f"retry after one ends (pushback {self.pushback_ms} ms)",
                trailing_metadata=retry_metadata(self.pushback_ms),
            )
        self._counts[tenant] += 1

    def release(self, tenant: str) -> None:
        """Gives back one slot taken by `take`."""
        self._counts[tenant] -= 1
        if self._counts[tenant] <= 0:
            del self._counts[tenant]
