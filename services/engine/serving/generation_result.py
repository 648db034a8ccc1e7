"""Collects a request's stream events into one result (the synchronous API and benchmarks use it)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from services.engine.scheduling.sequence import FinishReason, RequestId, StreamEvent


@dataclass(frozen=True)
class GenerationResult:
    """A finished request: its completion ids and text, why it ended, and how long it took."""

    request_id: RequestId
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # completion ids (an EOS that ended it is included)
    text: str  # completion text (stop string and special tokens excluded)
    finish_reason: FinishReason
    ttft_ms: float  # submit -> first token event
    latency_ms: float  # submit -> finished event
    error: str | None = None


class ResultCollector:
    """An `on_event` callback that accumulates events and signals when the request is done."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = tuple(prompt_ids)
        self.done = threading.Event()
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._start_s = time.perf_counter()
        self._first_token_s: float | None = None
        self._end_s = 0.0
        self._last: StreamEvent | None = None

    def __call__(self, event: StreamEvent) -> None:
        """Record one event (called on the engine thread)."""
        if event.token_ids and self._first_token_s is None:
            self._first_token_s = time.perf_counter()
        self._token_ids.extend(event.token_ids)
        self._text.append(event.text_delta)
        self._last = event
        if event.finished:
            self._end_s = time.perf_counter()
            self.done.set()

    @property
    def has_first_token(self) -> bool:
        """Whether a token has reached this collector."""
        return self._first_token_s is not None

    @property
    def final_event(self) -> StreamEvent | None:
        """The finished event (its usage and timeline), once `done` is set."""
        return self._last if self.done.is_set() else None

    def result(self) -> GenerationResult:
        """The finished result; only valid once `done` is set."""
        assert self._last is not None and self._last.finish_reason is not None, "request not finished"
        first = self._first_token_s if self._first_token_s is not None else self._end_s
        return GenerationResult(
            request_id=self._last.request_id,
            prompt_ids=self.prompt_ids,
            token_ids=tuple(self._token_ids),
            text="".join(self._text),
            finish_reason=self._last.finish_reason,
            ttft_ms=(first - self._start_s) * 1e3,
            latency_ms=(self._end_s - self._start_s) * 1e3,
            error=self._last.error,
        )
