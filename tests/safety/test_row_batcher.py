"""The row batcher: the rows of concurrent checks embedded together, on the real encoder."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from services.safety.embedder import CheckCancelled, CheckProgress, MiniLMEmbedder
from services.safety.row_batcher import RowBatcher

TEXTS = (
    "How do I repot a fern?",
    "The river froze early that winter.",
    "Write a haiku about rain.",
    "Which trains run to the coast on Sundays?",
    "Summarise the plot of a detective novel in two lines.",
)


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder.load()


class HeldForward:
    """The embedder's forward, held at its first round until released, so that checks queue
    behind it; records the rows of every round."""

    def __init__(self, embedder: MiniLMEmbedder) -> None:
        self.embedder = embedder
        self.rounds: list[list[list[int]]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, rows: list[list[int]]) -> torch.Tensor:
        self.rounds.append(rows)
        self.started.set()
        assert self.release.wait(timeout=60), "the test never released the first round"
        return self.embedder.embed_rows_now(rows)


@pytest.fixture
def held(embedder: MiniLMEmbedder) -> Iterator[tuple[HeldForward, RowBatcher]]:
    forward = HeldForward(embedder)
    batcher = RowBatcher(forward, rows_per_round=8)
    yield forward, batcher
    forward.release.set()
    batcher.close()


def _rows(embedder: MiniLMEmbedder, texts: tuple[str, ...]) -> list[list[int]]:
    return [embedder.text_windows(text)[0] for text in texts]


def _wait_until_waiting(batcher: RowBatcher, num_requests: int) -> None:
    """Blocks until `num_requests` requests are queued (the batcher notifies on each)."""
    with batcher._changed:
        assert batcher._changed.wait_for(lambda: len(batcher._waiting) == num_requests, timeout=60)


def _submit(
    pool: ThreadPoolExecutor, call: Callable[[], torch.Tensor], done: list[str], name: str
) -> Future[torch.Tensor]:
    def run() -> torch.Tensor:
        out = call()
        done.append(name)
        return out

    return pool.submit(run)


def test_the_rows_of_checks_that_wait_together_are_embedded_in_one_round(
    embedder: MiniLMEmbedder, held: tuple[HeldForward, RowBatcher]
) -> None:
    forward, batcher = held
    rows = _rows(embedder, TEXTS)
    done: list[str] = []
    with ThreadPoolExecutor(max_workers=len(rows)) as pool:
        first = _submit(pool, lambda: batcher.embed(rows[:1]), done, "first")
        assert forward.started.wait(timeout=60)
        # the rest come while the first round runs: one row each, and the last one two rows
        others = [
            _submit(pool, lambda r=row: batcher.embed([r]), done, f"row {i}")
            for i, row in enumerate(rows[1:3])
        ]
        others.append(_submit(pool, lambda: batcher.embed(rows[3:]), done, "two rows"))
        _wait_until_waiting(batcher, 4)
        forward.release.set()
        results = [first.result(timeout=60)] + [future.result(timeout=60) for future in others]
    assert [len(r) for r in forward.rounds] == [1, 4]
    assert batcher.max_checks_in_a_round == 3
    expected = embedder._embed_batch(rows)
    assert torch.allclose(torch.cat(results), expected, atol=1e-5)


def test_a_short_check_passes_a_long_one_that_came_first(
    embedder: MiniLMEmbedder, held: tuple[HeldForward, RowBatcher]
) -> None:
    forward, batcher = held
    long_rows = [
        [101, *embedder.token_ids(f"Line {n} of a long report about harbour traffic."), 102]
        for n in range(40)
    ]
    short_row = _rows(embedder, TEXTS[:1])
    done: list[str] = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        blocker = _submit(pool, lambda: batcher.embed(short_row), done, "blocker")
        assert forward.started.wait(timeout=60)
        long = _submit(pool, lambda: batcher.embed(long_rows), done, "long")
        _wait_until_waiting(batcher, 2)
        short = _submit(pool, lambda: batcher.embed(short_row), done, "short")
        _wait_until_waiting(batcher, 3)
        forward.release.set()
        long_out, short_out = long.result(timeout=60), short.result(timeout=60)
        blocker.result(timeout=60)
    # 8 rows a round: the long check's 40 take five rounds, the short check rides the first of them
    assert done == ["blocker", "short", "long"]
    assert [len(r) for r in forward.rounds] == [1, 8, 8, 8, 8, 8, 1]
    assert short_row[0] in forward.rounds[1]
    assert torch.allclose(long_out, embedder._embed_batch(long_rows), atol=1e-5)
    assert torch.allclose(short_out, embedder._embed_batch(short_row), atol=1e-5)


def test_a_check_whose_call_is_done_is_dropped_before_its_rows_are_embedded(
    embedder: MiniLMEmbedder, held: tuple[HeldForward, RowBatcher]
) -> None:
    forward, batcher = held
    rows = _rows(embedder, TEXTS)
    progress = CheckProgress()
    done: list[str] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = _submit(pool, lambda: batcher.embed(rows[:1]), done, "first")
        assert forward.started.wait(timeout=60)
        gone = _submit(pool, lambda: batcher.embed(rows[1:], progress), done, "gone")
        _wait_until_waiting(batcher, 2)
        progress.is_cancelled.set()
        forward.release.set()
        first.result(timeout=60)
        with pytest.raises(CheckCancelled):
            gone.result(timeout=60)
    assert progress.num_rows_embedded == 0
    assert len(forward.rounds) == 1


def test_a_failed_round_fails_its_checks_and_the_batcher_serves_the_next(embedder: MiniLMEmbedder) -> None:
    rows = _rows(embedder, TEXTS[:2])
    calls = []

    def forward(batch: list[list[int]]) -> torch.Tensor:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("out of memory in the first round")
        return embedder.embed_rows_now(batch)

    batcher = RowBatcher(forward)
    try:
        with pytest.raises(RuntimeError, match="out of memory in the first round"):
            batcher.embed(rows)
        progress = CheckProgress()
        out = batcher.embed(rows, progress)
    finally:
        batcher.close()
    assert progress.num_rows_embedded == 2
    assert torch.allclose(out, embedder._embed_batch(rows), atol=1e-5)


def test_an_embedder_with_a_batcher_answers_as_without_one_from_many_threads(
    embedder: MiniLMEmbedder,
) -> None:
    texts = [f"{text} Asked by reader {n}." for n in range(6) for text in TEXTS]
    alone = MiniLMEmbedder(embedder.w, embedder.tokenizer, embedder.spec)
    expected = [alone.embed([text]) for text in texts]
    batched = MiniLMEmbedder(embedder.w, embedder.tokenizer, embedder.spec)
    batched.batcher = RowBatcher(batched.embed_rows_now)
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda text: batched.embed([text]), texts))
    finally:
        batched.batcher.close()
    for text, got, want in zip(texts, results, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5), text


def test_a_closed_batcher_refuses_rows_and_no_rows_is_an_error(embedder: MiniLMEmbedder) -> None:
    batcher = RowBatcher(embedder.embed_rows_now)
    with pytest.raises(ValueError, match="no rows"):
        batcher.embed([])
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.embed(_rows(embedder, TEXTS[:1]))
