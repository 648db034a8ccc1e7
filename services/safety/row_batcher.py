"""The rows of concurrent checks, embedded together: one encoder pass serves many checks.

The safety service runs several checks at once (servicer.py, `THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS`).
Each check turns its texts into rows (embedder.py's windows) and needs their embeddings. Most checks
are output screens of a stream, which embed one or two new rows, and on a CPU a pass over one short
row costs nearly as much as a pass over eight. So the rows go to one thread, the batcher's, which
embeds the rows of every waiting check in one batch.

A round takes what waited while the last one ran, with no timer. A lone check waits for nothing,
and a flood of checks forms its own batches. Each round gives every waiting check a share of
`rows_per_round`, one row at a time in turn. A short check therefore finishes in its first round
and passes a long one (a chat of hundreds of messages) that would have held the one checker thread
for seconds. A check whose call is done is dropped between rounds. Every encoder pass runs on the
batcher's thread, so the large activations come from one malloc arena, as with one checker thread
(services/common/heap.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from services.safety.embedder import DEFAULT_BATCH_SIZE, CheckCancelled, CheckProgress


class _Request:
    """One check's rows to embed, and how far the rounds have come through them."""

    def __init__(self, rows: list[list[int]], progress: CheckProgress | None) -> None:
        self.rows = rows
        self.progress = progress
        self.future: Future[torch.Tensor] = Future()
        self.next_row = 0  # rows before it are embedded
        self.parts: list[torch.Tensor] = []

    @property
    def num_left(self) -> int:
        return len(self.rows) - self.next_row

    @property
    def is_cancelled(self) -> bool:
        return self.progress is not None and self.progress.is_cancelled.is_set()

    def add(self, embeddings: torch.Tensor) -> None:
        """Takes the embeddings of its next rows, counted in its progress."""
        self.parts.append(embeddings)
        self.next_row += len(embeddings)
        if self.progress is not None:
            self.progress.num_rows_embedded += len(embeddings)
            self.progress.on_rows_embedded(len(embeddings))


class RowBatcher:
    """Embeds rows for many threads at once on a thread of its own.

    `forward` embeds a list of rows in order (MiniLMEmbedder.embed_rows_now: bucketed by length,
    each bucket one pass); it runs only on the batcher's thread. `close` stops the thread once
    the rows waiting are done."""

    def __init__(
        self,
        forward: Callable[[list[list[int]]], torch.Tensor],
        # the embedder's batch: a long check alone runs as it would without the batcher, and a
        # short check waits for at most one such batch
        rows_per_round: int = DEFAULT_BATCH_SIZE,
        on_round: Callable[[int], None] = lambda num_checks: None,
    ) -> None:
        if rows_per_round < 1:
            raise ValueError(f"rows_per_round must be at least 1, got {rows_per_round}")
        self._forward = forward
        self._on_round = on_round  # told each round's checks (the service's metrics)
        self.rows_per_round = rows_per_round
        self._waiting: list[_Request] = []
        self._changed = threading.Condition()
        self._is_closed = False
        self.max_checks_in_a_round = 0  # for the tests
        self._thread = threading.Thread(target=self._run, name="safety-embed", daemon=True)
        self._thread.start()

    def embed(self, rows: list[list[int]], progress: CheckProgress | None = None) -> torch.Tensor:
        """Embeddings of `rows`, in order, once the batcher's rounds have reached them all.
        CheckCancelled when `progress` says the check's call is done before they have; the
        forward's own error when a round with these rows failed."""
        if not rows:
            raise ValueError("no rows to embed")
        request = _Request(rows, progress)
        with self._changed:
            if self._is_closed:
                raise RuntimeError("the safety service's row batcher is closed")
            self._waiting.append(request)
            self._changed.notify_all()
        return request.future.result()

    def close(self) -> None:
        """Stops the batcher's thread after the rows waiting now."""
        with self._changed:
            self._is_closed = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._is_closed:
                    self._changed.wait()
                if not self._waiting:
                    return
                waiting = list(self._waiting)
            done = [r for r in waiting if r.is_cancelled]
            for request in done:
                request.future.set_exception(CheckCancelled("the check's call is done"))
            shares = self._shares([r for r in waiting if not r.is_cancelled])
            if shares:
                done += self._round(shares)
            with self._changed:
                self._waiting = [r for r in self._waiting if r not in done]

    def _shares(self, requests: list[_Request]) -> list[tuple[_Request, int]]:
        """How many rows each request gives this round: one each in turn, in the order they came,
        until the round is full or the rows run out."""
        counts = dict.fromkeys(requests, 0)
        budget = self.rows_per_round
        while budget:
            takers = [r for r in requests if counts[r] < r.num_left][:budget]
            if not takers:
                break
            for request in takers:
                counts[request] += 1
            budget -= len(takers)
        return [(r, n) for r, n in counts.items() if n]

    def _round(self, shares: list[tuple[_Request, int]]) -> list[_Request]:
        """Embeds one round's rows (a row that two checks share, once) and hands them out; returns
        the requests it finished."""
        rows = [r.rows[r.next_row + i] for r, n in shares for i in range(n)]
        unique = {tuple(row): i for i, row in enumerate(dict.fromkeys(map(tuple, rows)))}
        try:
            embedded = self._forward([list(row) for row in unique])
        except Exception as error:  # every check in the round fails with it; the thread goes on
            for request, _ in shares:
                request.future.set_exception(error)
            return [request for request, _ in shares]
        self.max_checks_in_a_round = max(self.max_checks_in_a_round, len(shares))
        self._on_round(len(shares))
        embeddings = embedded[[unique[tuple(row)] for row in rows]]
        finished, start = [], 0
        for request, num_rows in shares:
            request.add(embeddings[start : start + num_rows])
            start += num_rows
            if request.num_left == 0:
                request.future.set_result(torch.cat(request.parts))
                finished.append(request)
        return finished
