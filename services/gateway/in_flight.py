"""The Generate streams a gateway is relaying, so a drain that runs out of grace can cut them and say
which it cut.

A cut is a flag and a cancellation, as `asyncio.timeout` is. The cancellation interrupts the
stream's task wherever it waits: on the engine, on safety, on the audit log, or in a write to a
client that reads slowly (the shared write loop hands that one to the stream at its `yield`,
services/common/interceptors.py). The flag tells the stream's own code that it was cut, not left by
its client or stalled, and that code ends it (GatewayServicer.Generate): the cut is audited, and the
call ends UNAVAILABLE with the count of tokens sent. A flag alone would be seen only between
messages: it cannot end a wait on the engine or on a client that never reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.gateway.gatekeeper import Admission

log = logging.getLogger(__name__)


@dataclass
class InFlightStream:
    """One Generate call: its task, its admission once admitted, how far it got, whether it was cut."""

    task: asyncio.Task[Any]
    admission: Admission | None = None
    num_tokens: int = 0
    is_cut: bool = False

    def cut(self) -> None:
        """Marks the stream cut and interrupts its task wherever it waits."""
        self.is_cut = True
        self.task.cancel()


class InFlightStreams:
    """The admitted streams in flight. `track` adds one for a body's duration; `cut_all` cuts them all."""

    def __init__(self) -> None:
        self._streams: dict[int, InFlightStream] = {}

    @contextmanager
    def track(self, stream: InFlightStream, admission: Admission) -> Iterator[None]:
        """Tracks `stream`, admitted as `admission`, for the body's duration."""
        stream.admission = admission
        self._streams[id(stream)] = stream
        try:
            yield
        finally:
            del self._streams[id(stream)]

    def cut_all(self) -> list[InFlightStream]:
        """Cuts every stream in flight (each then ends UNAVAILABLE, saying it was cut); returns them."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.cut()
        if streams:
            log.warning(
                "grace period over: cutting %d stream(s): %s",
                len(streams),
                ", ".join(_described(stream) for stream in streams),
            )
        return streams


def _described(stream: InFlightStream) -> str:
    admission = stream.admission
    assert admission is not None  # tracked streams are admitted
    client = f"client request id {admission.client_request_id}, " if admission.client_request_id else ""
    tenant = admission.principal.tenant
    return f"{admission.request_id} ({client}tenant {tenant}, {stream.num_tokens} tokens sent)"
