"""The filter that samples uvicorn's warnings, on real log records and a fake clock."""

from __future__ import annotations

import logging

from services.gateway.http.sampled_log import SampledLog

INTERVAL_S = 60.0
INVALID = "Invalid HTTP request received."


class FakeClock:
    """Seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    """A record as uvicorn's logger makes one."""
    return logging.LogRecord("uvicorn.error", level, __file__, 1, message, None, None)


def written(sampled: SampledLog, records: list[logging.LogRecord]) -> list[str]:
    """The messages of the records the filter lets through."""
    return [r.getMessage() for r in records if sampled.filter(r)]


def test_the_first_passes_then_one_an_interval_with_the_count() -> None:
    clock = FakeClock()
    sampled = SampledLog(INTERVAL_S, clock)
    assert written(sampled, [record(INVALID) for _ in range(50)]) == [INVALID]
    clock.now_s += INTERVAL_S - 1
    assert written(sampled, [record(INVALID)]) == []
    clock.now_s += 1
    (line,) = written(sampled, [record(INVALID) for _ in range(5)])
    assert line.startswith(INVALID) and "51 times since the last such line" in line
    clock.now_s += INTERVAL_S
    (line,) = written(sampled, [record(INVALID)])
    assert line == f"{INVALID} (5 times since the last such line; logged at most once every 60 s)"


def test_each_message_has_its_own_tally_and_errors_pass() -> None:
    sampled = SampledLog(INTERVAL_S, FakeClock())
    other = "Exceeded concurrency limit."
    records = [record(INVALID), record(other), record(INVALID), record(other)]
    assert written(sampled, records) == [INVALID, other]
    errors = [record("Exception in ASGI application", logging.ERROR) for _ in range(3)]
    assert len(written(sampled, errors)) == 3
