"""A scheduler clock for tests: time stands still until the test moves it."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves by hand (set `now`); the Scheduler's `clock` in its tests."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
