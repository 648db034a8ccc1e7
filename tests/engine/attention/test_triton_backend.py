"""The fused backend inside the engine, on the CPU through Triton's interpreter (or on a GPU where there
is one): greedy output equals the reference backend's with the tiers on, where later prefill chunks
read their warm prefix from dequantized pages and decode reads the warm tier in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.attention.triton_backend import (
    MAX_PREFILL_SEGMENTS,
    MAX_SEGMENTS,
    MAX_WARM_SEGMENTS,
    TritonBackend,
)
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine, warm_up_requests
from services.engine.model.config import ModelConfig
from services.engine.scheduling.intent_class import IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton takes no CPU tensors

# A hot window small enough that a 300-token prompt, prefilled 64 tokens at a time, has warm groups
# before its later chunks.
TIERED = KVCacheSpec(
    block_size=16,
    num_hot_blocks=1 + 64,
    num_warm_groups=64,
    tiers=TierConfig(enabled=True, sink_tokens=4, hot_tokens=48, warm_tokens=4096, group_size=32),
)


def _greedy(
    path: Path,
    attention: str,
    min_prefix_page_tokens: int | None = None,
    classes: IntentClasses | None = None,
) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.load(
        path, device=DEVICE, dtype="float32", max_batch_size=2, max_seq_len=512, kv=TIERED,
        max_prefill_tokens=64, attention=attention, progress=False, classes=classes,
    )  # fmt: skip
    if min_prefix_page_tokens is not None:
        engine.runner.attention.min_prefix_page_tokens = min_prefix_page_tokens
    generator = torch.Generator().manual_seed(11)
    # 200 tokens in 64-token chunks: the last three read a warm prefix past the 4 sink + 48 hot tokens
    prompts = [torch.randint(1, 384, (n,), generator=generator).tolist() for n in (200, 100)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        # the batch class waits up to 600 s for admission: the interpreter is slow on a loaded machine,
        # and the second prompt waits while the first one's chunks take each step's prefill budget
        engine.submit(prompt, params, collector, intent_class="batch")
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    results = [c.result() for c in collectors]
    assert all(r.error is None for r in results), [r.error for r in results]
    return [list(r.token_ids) for r in results], engine


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "in-place"])
def test_chunked_prefill_over_a_warm_prefix_equals_the_reference(tiny_dir: Path, pages: bool) -> None:
    """64-token chunks over a warm prefix, read from dequantized pages or (as the engine reads chunks
    under PREFIX_PAGES_MIN_QUERY_TOKENS) in place: the reference's greedy tokens either way."""
    reference, _ = _greedy(tiny_dir, "reference")  # a tiny random Llama: two layers, GQA 4:2
    fused, engine = _greedy(tiny_dir, "triton", min_prefix_page_tokens=1 if pages else None)
    backend = engine.runner.attention
    assert isinstance(backend, TritonBackend)
    assert (backend.num_prefix_layer_calls > 0) == pages  # the warm prefix really was read from pages
    assert backend.num_split_layer_calls > 0  # and decode split the rows' contexts (flash-decoding)
    assert fused == reference


def test_decode_splits_long_contexts_to_fill_the_gpu() -> None:
    """Flash-decoding: few rows over long contexts get many programs each; short contexts get none.
    With a warm tier the split goes on to the one-warp launch's programs, in segments of 8 tiles."""
    config = ModelConfig(vocab_size=8, hidden_size=32 * 128, intermediate_size=8, num_layers=1,
                         num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
    cache = KVCache(HotTier(config, 4, 16, torch.device("cpu"), torch.float32), None)
    backend = TritonBackend(cache, num_heads=32, max_decode_rows=16)
    assert backend.num_segments(16, 32768) == 8  # 16 rows x 8 KV heads x 8 segments: ~8 programs per SM
    assert backend.num_segments(1, 32768) == MAX_SEGMENTS
    assert backend.num_segments(1, 1024) == 4  # segments of MIN_TOKENS_PER_SEGMENT positions, no shorter
    assert backend.num_segments(1, 200) == 1
    assert backend.partials.max.numel() >= 16 * 32 * 8  # the largest split of up to 16 rows fits
    warm = WarmTier(config, 4, 32, torch.device("cpu"))
    tiered = TritonBackend(KVCache(HotTier(config, 4, 16, torch.device("cpu"), torch.float32), warm), 32, 16)
    assert tiered.num_segments(1, 32768) == MAX_WARM_SEGMENTS  # 8 KV heads x 128: the one-warp launch
    assert tiered.num_segments(16, 1024) == 8  # 1,024 programs of 8 tiles
    assert tiered.num_segments(16, 32768) == 8
    assert tiered.num_segments(1, 1024) == 8  # no segment under MIN_WARM_TOKENS_PER_SEGMENT
    assert tiered.num_segments(1, 100) == 1
    assert tiered.partials.max.numel() >= 32 * max(r * tiered.num_segments(r, 1 << 20) for r in range(1, 17))


def test_prefill_splits_only_short_chunks_over_long_contexts() -> None:
    """A 16-token chunk after a 32K prefix is one query block per KV head: it splits into segments of
    a few tiles. A whole 32K prompt, or a short prompt, does not split. The workspace bounds the
    (token, segment) pairs."""
    config = ModelConfig(vocab_size=8, hidden_size=32 * 128, intermediate_size=8, num_layers=1,
                         num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
    cache = KVCache(HotTier(config, 4, 16, torch.device("cpu"), torch.float32), None)
    backend = TritonBackend(cache, num_heads=32, max_decode_rows=16)
    assert backend.prefill_segments(16, 1, 16, 32784) == MAX_PREFILL_SEGMENTS
    assert backend.prefill_segments(16, 1, 16, 1040) == 4  # segments of at least 256 positions
    assert backend.prefill_segments(200, 1, 200, 300) == 1
    assert backend.prefill_segments(16384, 1, 16384, 32768) == 1  # 8,192 programs already
    assert backend.prefill_segments(512, 1, 512, 33280) == 4  # 256 programs; the workspace caps it
    for tokens in (1, 16, 100, 512, 2048):
        segments = backend.prefill_segments(tokens, 1, tokens, 1 << 20)
        assert tokens * segments <= backend.partials.max.numel() // 32
    # a prefill launch of 32 rows a program (PREFILL_LAUNCH) doubles the query blocks: half the split
    assert backend.prefill_segments(64, 1, 64, 32832) == 32
    backend.prefill_launch = {"block_m": 32}
    assert backend.prefill_segments(64, 1, 64, 32832) == 16


def test_warm_up_serves_its_requests_and_leaves_nothing_a_real_prompt_can_reuse(
    tiny_dir: Path, monkeypatch
) -> None:
    """The start-up warm-up (run here on the interpreted fused backend, as on CUDA): its requests
    finish, hold no blocks afterwards, and their salted prefix blocks serve no real prompt, even one
    with the same tokens."""
    engine = LLMEngine.load(
        tiny_dir, device=DEVICE, dtype="float32", max_batch_size=4, max_seq_len=128, kv=TIERED,
        max_prefill_tokens=16, attention="triton", progress=False,
    )  # fmt: skip
    if DEVICE == "cpu":
        assert engine.warm_up() == 0.0  # on the CPU nothing compiles: no warm-up
    monkeypatch.setattr(engine, "_compiles_kernels", lambda: True)
    assert engine.warm_up() > 0.0
    assert not engine.scheduler.has_work and engine.stats().num_running == 0
    assert engine.runner.num_mixed_steps > 0  # the short request decoded beside the long ones' chunks
    _, (long, _), _ = warm_up_requests(engine.config.vocab_size, 16, engine.max_seq_len)
    cached = engine.scheduler.num_prompt_tokens_cached
    engine.generate([long], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert engine.scheduler.num_prompt_tokens_cached == cached  # the salt keeps its blocks apart
