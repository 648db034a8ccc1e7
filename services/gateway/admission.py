"""Load shedding: at most `max_streams` Generate streams in flight per gateway process.

A call beyond the cap is refused at once with RESOURCE_EXHAUSTED and pushback metadata, before
any other work, so an overloaded gateway spends nothing on calls it cannot serve; streams
already admitted run to completion.
"""

from __future__ import annotations

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
