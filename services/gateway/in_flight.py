"""The Generate streams a gateway is relaying, so a drain that runs out of grace can say which it cut."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class InFlightStream:
    """One stream being relayed: who asked, how far it got, and whether the drain cut it."""

    request_id: str
    tenant: str
    task: asyncio.Task[object] | None
    num_tokens: int = 0
    is_cut: bool = False


class InFlightStreams:
    """The streams in flight. `track` adds one for a body's duration; `cut_all` cancels them all."""

    def __init__(self) -> None:
        self._streams: dict[int, InFlightStream] = {}

    @contextmanager
    def track(self, request_id: str, tenant: str) -> Iterator[InFlightStream]:
        """Tracks the current task's stream for the body's duration."""
        stream = InFlightStream(request_id, tenant, asyncio.current_task())
        self._streams[id(stream)] = stream
        try:
            yield stream
        finally:
            del self._streams[id(stream)]

    def cut_all(self) -> list[InFlightStream]:
        """Cancels every stream in flight (each then ends UNAVAILABLE, saying it was cut); returns them."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.is_cut = True
            if stream.task is not None:
                stream.task.cancel()
        if streams:
            log.warning(
                "grace period over: cutting %d stream(s): %s",
                len(streams),
                ", ".join(f"{s.request_id} (tenant {s.tenant}, {s.num_tokens} tokens sent)" for s in streams),
            )
        return streams
