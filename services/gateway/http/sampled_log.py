"""uvicorn's own warnings, each at most once a minute with the count of those held back.

uvicorn logs a WARNING on its `uvicorn.error` logger for every request it refuses before the
application sees it: a head h11 cannot parse ("Invalid HTTP request received."), a request past
`limit_concurrency`, an unsupported upgrade. Any client could fill the gateway's log with them as
fast as it can open connections. `SampledLog`, a filter on that logger (server.py), lets each
message's first record through, then one per interval that says how many came since the last
line, as the service-token refusals are logged (services/common/service_auth.py). Errors pass
unsampled: each carries its own stack trace.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.service_auth import REFUSAL_LOG_INTERVAL_S

UVICORN_LOGGER = "uvicorn.error"


@dataclass
class _Tally:
    """One message's records since its last line, and when that line was written."""

    num_held: int = 0
    last_logged_s: float = -math.inf


class SampledLog(logging.Filter):
    """A logging filter: a record below ERROR passes at most once per `interval_s` for each message
    (its format string), the one that passes saying how many came since the last. `filter` changes
    the tallies and the record it passes."""

    def __init__(
        self, interval_s: float = REFUSAL_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._tallies: dict[str, _Tally] = {}  # uvicorn's messages are a fixed few format strings

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether `record` is written; the count goes into the message of one that is."""
        if record.levelno >= logging.ERROR:
            return True
        tally = self._tallies.setdefault(str(record.msg), _Tally())
        tally.num_held += 1
        now = self.clock()
        if now - tally.last_logged_s < self.interval_s:
            return False
        if tally.num_held > 1:
            record.msg = (
                f"{record.msg} ({tally.num_held} times since the last such line; "
                f"logged at most once every {self.interval_s:g} s)"
            )
        tally.num_held, tally.last_logged_s = 0, now
        return True
