"""The embedder's window cache: a window seen before is not computed again, and answers as computed."""

from __future__ import annotations

import pytest
import torch

from services.safety import embedder as embedder_module
from services.safety.embedder import CheckProgress, MiniLMEmbedder

TEXTS = ("How do I repot a fern?", "The river froze early that winter.", "Write a haiku about rain.")


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder.load()


def _rows(embedder: MiniLMEmbedder, texts: tuple[str, ...]) -> list[list[int]]:
    return [embedder.text_windows(text)[0] for text in texts]


def test_a_window_seen_before_is_not_embedded_again(embedder: MiniLMEmbedder) -> None:
    rows = _rows(embedder, TEXTS)
    first, again = CheckProgress(), CheckProgress()
    computed = embedder.embed_windows(rows, progress=first)
    # the output screen's case: the same text again with one window more at its end
    grown = embedder.embed_windows([*rows, rows[0][:5]], progress=again)
    assert first.num_rows_embedded == 3 and again.num_rows_embedded == 1
    assert torch.equal(grown[:3], computed)
    assert torch.allclose(grown[3], embedder._embed_batch([rows[0][:5]])[0], atol=1e-5)


def test_a_repeated_row_is_embedded_once_and_answers_in_order(embedder: MiniLMEmbedder) -> None:
    rows = _rows(embedder, ("Tell me about tides.", "Name three birds."))
    progress = CheckProgress()
    out = embedder.embed_windows([rows[1], rows[0], rows[1]], progress=progress)
    assert progress.num_rows_embedded == 2
    expected = embedder._embed_batch(rows)
    assert torch.allclose(out, expected[[1, 0, 1]], atol=1e-5)


def test_new_weights_empty_the_cache(embedder: MiniLMEmbedder) -> None:
    rows = _rows(embedder, ("A quiet street at dawn.",))
    before = embedder.embed_windows(rows)
    weights = embedder.w
    embedder.w = {
        name: tensor * 1.01 if name.endswith("dense.weight") else tensor for name, tensor in weights.items()
    }
    try:
        progress = CheckProgress()
        after = embedder.embed_windows(rows, progress=progress)
        assert progress.num_rows_embedded == 1 and not torch.allclose(after, before)
    finally:
        embedder.w = weights


def test_the_cache_keeps_the_most_recent_windows_only(
    embedder: MiniLMEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder_module, "MAX_CACHED_WINDOWS", 2)
    rows = _rows(embedder, ("One small cat.", "Two tall trees.", "Three red kites."))
    embedder.embed_windows(rows)  # the first row is pushed out by the third
    progress = CheckProgress()
    embedder.embed_windows(rows[1:], progress=progress)
    assert progress.num_rows_embedded == 0
    embedder.embed_windows(rows[:1], progress=progress)
    assert progress.num_rows_embedded == 1
