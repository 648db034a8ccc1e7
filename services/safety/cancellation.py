"""The cancel flag of the check running in this context, for the stages that are not handed it.

Screen.check passes its CheckProgress to the classifier, which reads it between stages; but the
decoders (decoders.py) and the language screen (language.py) run inside single stages, under calls
that take no progress (normalizer.views, foreign_share_of_views), and a long text kept them busy
for seconds after its caller had gone, while every other check queued behind the one checker
thread. Screen.check sets its progress here (`observing`), and those loops call
`raise_if_cancelled` every so often. A context variable, not a global: the servicer runs each
check in a copy of its context, and a caller without a progress (training, tests) is never
stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.safety.embedder import CheckProgress

_PROGRESS: ContextVar[CheckProgress | None] = ContextVar("safety_check_progress", default=None)


@contextmanager
def observing(progress: CheckProgress | None) -> Iterator[None]:
    """Makes `progress` the one `raise_if_cancelled` reads in this context, until the block ends."""
    token = _PROGRESS.set(progress)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def raise_if_cancelled() -> None:
    """CheckCancelled once the call of the check running in this context is done; nothing when no
    check observes its progress here."""
    if (progress := _PROGRESS.get()) is not None:
        progress.raise_if_cancelled()
