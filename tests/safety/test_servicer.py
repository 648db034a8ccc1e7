"""The servicer's checks in process, on a fake screen (tests/safety/test_service.py runs the real
service over gRPC)."""

from __future__ import annotations

import pytest

from services.common.config import ServerConfig
from services.safety.cancellation import raise_if_cancelled
from services.safety.config import DEFAULT_PATTERNS, SafetyConfig
from services.safety.embedder import CheckCancelled, CheckProgress
from services.safety.screen import Screen
from services.safety.servicer import SafetyServicer
from services.safety.tenant_policy import NO_POLICY


class _DecodingScreen:
    """A screen whose check is one long stage that takes no progress, as the decoders are: it
    reads the cancel flag only through cancellation.py."""

    def check(self, *args: object) -> None:
        raise_if_cancelled()


def test_a_check_whose_call_is_done_stops_inside_a_stage_that_takes_no_progress() -> None:
    """The decoders and the language screen ran a 210 KB prompt for 24 s after its caller had
    gone, every other check queued behind it: they are handed no progress, and read the one the
    servicer observes for them."""
    config = SafetyConfig(ServerConfig("safety"), DEFAULT_PATTERNS, "I can't help with that request.")
    screen: Screen = _DecodingScreen()  # type: ignore[assignment]
    servicer = SafetyServicer(config, screen)
    progress = CheckProgress()
    progress.is_cancelled.set()
    with pytest.raises(CheckCancelled):
        servicer._screen(progress, "prompt", "text", NO_POLICY, ())
