"""Tensor parallelism on the CPU with gloo: TP=2 gives TP=1's tokens, and bad splits are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.errors import EngineStopped
from services.engine.execution.tp_workers import CacheShape
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import FinishReason, LLMEngine, SamplingParams
from services.engine.model.config import ModelConfig
from services.engine.model.tensor_parallel import (
    TensorParallel,
    TensorParallelError,
    shard_config,
    sharded_dim,
)
from services.engine.serving.generation_result import ResultCollector
from tests.engine.tiny_llama import TinySpec, make_tiny_llama

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


def _tokens(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[tuple[int, ...]]:
    return [r.token_ids for r in engine.generate(prompts, params)]


def _load_pair(path: Path, **kwargs: object) -> tuple[LLMEngine, LLMEngine]:
    single = LLMEngine.load(path, device="cpu", progress=False, **kwargs)  # type: ignore[arg-type]
    parallel = LLMEngine.load(path, device="cpu", progress=False, tp=2, **kwargs)  # type: ignore[arg-type]
    return single, parallel


def test_tp2_equals_tp1_under_continuous_batching(tiny_dir: Path) -> None:
    """Six requests of different lengths through two slots: rows join and leave mid-decode."""
    kv = KVCacheSpec(
        block_size=16, num_hot_blocks=1 + 5
    )  # tight: the highest block ids get used, and preemption
    single, parallel = _load_pair(tiny_dir, max_batch_size=2, max_seq_len=256, kv=kv)
    prompts = [[5 + i, 6, 7 + 2 * i, 8] * (1 + i % 3) for i in range(6)]
    params = [SamplingParams(max_new_tokens=8 + 5 * (i % 4), temperature=0.0) for i in range(6)]
    try:
        expected = _tokens(single, prompts, params)
        assert _tokens(parallel, prompts, params) == expected
        assert sum(len(t) for t in expected) > 60  # the requests really decoded
    finally:
        parallel.stop()


def test_tp2_equals_tp1_with_tiers_on_and_demotions_replayed(tmp_path: Path) -> None:
    """With a 32-token hot window, rank 0's demotions to INT4 must be replayed on rank 1."""
    path = make_tiny_llama(tmp_path / "tiny", TinySpec(num_heads=4, num_kv_heads=2, llama3_rope=False))
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=512, group_size=32)
    kv = KVCacheSpec(block_size=16, tiers=tiers)
    single, parallel = _load_pair(path, max_batch_size=2, max_seq_len=256, kv=kv)
    prompts = [list(range(5, 85)), list(range(100, 140))]
    params = [SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)] * 2
    try:
        expected, _ = _step_through(single, prompts, params)
        tokens, max_warm_tokens = _step_through(parallel, prompts, params)
        assert tokens == expected
        assert max_warm_tokens >= 64  # groups were demoted while decoding, so rank 1 replayed them
    finally:
        parallel.stop()


def _step_through(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[tuple[int, ...]], int]:
    """Run to completion one step at a time; returns the tokens and the most warm tokens held."""
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, p, collector in zip(prompts, params, collectors, strict=True):
        engine.submit(prompt, p, collector)
    max_warm_tokens = 0
    while not all(c.done.is_set() for c in collectors):
        engine.step()
        max_warm_tokens = max(max_warm_tokens, engine.stats().num_warm_tokens)
    return [c.result().token_ids for c in collectors], max_warm_tokens


def test_tp2_equals_tp1_on_stories260k(stories_hf_dir: Path) -> None:
    single, parallel = _load_pair(stories_hf_dir, max_batch_size=4, max_seq_len=256)
    tokenizer = single.tokenizer
    prompts = [tokenizer.encode(t) for t in ("Once upon a time", "The little dog", "Lily and Tom went")]
    try:
        assert _tokens(parallel, prompts, [GREEDY] * 3) == _tokens(single, prompts, [GREEDY] * 3)
    finally:
        parallel.stop()


def test_a_split_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_dir: Path) -> None:
    with pytest.raises(TensorParallelError, match=r"tp=3 does not divide .*use one of \[1, 2\]"):
        LLMEngine.load(tiny_dir, device="cpu", progress=False, tp=3)


def test_every_rank_builds_a_cache_of_rank_0s_shape(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", progress=False, kv=KVCacheSpec(num_hot_blocks=7))
    cache = engine.runner.kv_cache
    rebuilt = CacheShape.of(cache).build(engine.runner.model.rank_config, torch.device("cpu"), torch.float32)
    assert rebuilt.hot.keys.shape == cache.hot.keys.shape
    assert rebuilt.hot.pool.num_blocks == cache.hot.pool.num_blocks


def test_shard_config_divides_heads_and_mlp_width_only() -> None:
    config = ModelConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    rank = shard_config(config, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 48)
    assert (rank.hidden_size, rank.head_dim, rank.vocab_size) == (64, 16, 32)


def test_each_rank_keeps_its_own_slice_of_sharded_weights() -> None:
    weight = torch.arange(24.0).view(4, 6)
    assert sharded_dim("layers.0.self_attn.q_proj.weight") == 0
    assert sharded_dim("layers.3.mlp.down_proj.weight") == 1
    assert sharded_dim("embed_tokens.weight") is None
    rank1 = TensorParallel(rank=1, size=2)
    assert torch.equal(rank1.shard("layers.0.self_attn.k_proj.weight", weight), weight[2:])
    assert torch.equal(rank1.shard("layers.0.self_attn.o_proj.weight", weight), weight[:, 3:])
    assert rank1.shard("norm.weight", weight) is weight


def test_a_lost_rank_fails_the_step_at_once_and_new_requests_are_refused(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, progress=False, tp=2)
    try:
        rank1 = engine.runner.followers.processes[0]  # type: ignore[union-attr]
        rank1.kill()
        rank1.join()
        result = engine.generate([[5, 6, 7, 8]], GREEDY)[0]
        assert result.finish_reason is FinishReason.ERROR
        assert result.error is not None and "tensor-parallel rank 1 exited" in result.error
        with pytest.raises(EngineStopped, match=r"rank 1 exited .* another replica"):
            engine.submit([5, 6, 7], GREEDY, ResultCollector([5, 6, 7]))
    finally:
        engine.stop()
