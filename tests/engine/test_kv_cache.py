"""ContiguousKVCache on a 1-head, head-size-1 fake config: scatter, visible window, dense compaction."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_cache import ContiguousKVCache, SlotMove
from services.engine.model_config import ModelConfig
from services.engine.step_context import StepContext

CPU = torch.device("cpu")
ONE_HEAD = ModelConfig(
    vocab_size=4, hidden_size=2, intermediate_size=2, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=2
)


def _cache(slots: int = 3, seq_len: int = 8) -> ContiguousKVCache:
    return ContiguousKVCache(ONE_HEAD, slots, seq_len, CPU, torch.float32)


def _values(rows: list[list[float]]) -> torch.Tensor:
    return (
        torch.tensor(rows, dtype=torch.float32).view(len(rows), len(rows[0]), 1, 1).expand(-1, -1, 1, 2)
    )  # [B, S, 1, D]


def test_store_scatters_by_position_and_returns_the_visible_window() -> None:
    cache = _cache()
    for _ in range(2):
        cache.allocate()
    ctx = StepContext.build(0, [[0, 1, 2], [0, 1, 2]], CPU)
    keys, _ = cache.store(0, _values([[1, 2, 3], [4, 5, 6]]), _values([[1, 2, 3], [4, 5, 6]]), ctx)
    assert keys.shape == (2, 1, 3, 2)  # [B, KVH, L, D]
    decode = StepContext.build(0, [[3], [5]], CPU)  # rows at different lengths
    keys, _ = cache.store(0, _values([[7], [8]]), _values([[7], [8]]), decode)
    assert keys.shape == (2, 1, 6, 2)
    assert keys[0, 0, :, 0].tolist() == [1, 2, 3, 7, 0, 0]
    assert keys[1, 0, :, 0].tolist() == [4, 5, 6, 0, 0, 8]
    assert decode.attn_mask[0, 0, 0].tolist() == [True] * 4 + [False] * 2


def test_free_moves_the_last_slot_into_the_hole() -> None:
    cache = _cache()
    slots = [cache.allocate() for _ in range(3)]
    assert slots == [0, 1, 2] and cache.num_free_slots() == 0
    ctx = StepContext.build(2, [[0]], CPU)
    cache.store(1, _values([[9]]), _values([[9]]), ctx)  # layer 1, slot 2
    assert cache.free(0) == SlotMove(from_slot=2, to_slot=0)
    assert cache.keys[1, 0, 0, 0].tolist() == [9, 9]
    assert cache.free(1) is None  # the last live slot: nothing to move
    assert cache.num_free_slots() == 2


def test_allocate_beyond_capacity_is_an_error() -> None:
    cache = _cache(slots=1)
    cache.allocate()
    with pytest.raises(RuntimeError, match="num_free_slots"):
        cache.allocate()
