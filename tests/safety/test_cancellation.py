"""The cancel flag of the check running in this context (services/safety/cancellation.py)."""

from __future__ import annotations

import pytest

from services.safety.cancellation import observing, raise_if_cancelled
from services.safety.embedder import CheckCancelled, CheckProgress


def _cancelled() -> CheckProgress:
    progress = CheckProgress()
    progress.is_cancelled.set()
    return progress


def test_a_cancelled_check_observed_here_stops_at_the_next_look() -> None:
    with observing(_cancelled()), pytest.raises(CheckCancelled):
        raise_if_cancelled()


def test_nothing_stops_once_the_check_is_no_longer_observed() -> None:
    with observing(_cancelled()):
        pass
    raise_if_cancelled()  # outside any check: a training tool's views are never cancelled


def test_an_inner_check_without_progress_hides_the_outer_one_until_it_ends() -> None:
    with observing(_cancelled()):
        with observing(None):
            raise_if_cancelled()
        with pytest.raises(CheckCancelled):
            raise_if_cancelled()
