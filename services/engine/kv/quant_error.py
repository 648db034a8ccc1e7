"""An estimate of the error the INT4 warm tier adds: KIVI round trips of sampled hot-tier KV.

The warm tier keeps only codes, scales and zeros, so its error cannot be read back after the
fact. Instead, when /metrics is scraped (at most once per `min_interval_s`), a few groups of
held hot blocks from the last layer go through the same `kivi` quantize/dequantize that
demotion uses, and the relative L2 error is reported for keys and values. This runs on the
scrape thread; the decode loop does no extra work and no extra host sync. Blocks are read
without the engine's lock: a block rewritten mid-read only perturbs one sample of an estimate.
"""

from __future__ import annotations

import random
import threading
import time
from typing import NamedTuple

import torch

from services.engine.kv import kivi
from services.engine.kv.cache import HotTier

DEFAULT_NUM_SAMPLES = 8  # groups per estimate
DEFAULT_MIN_INTERVAL_S = 10.0


class QuantizationError(NamedTuple):
    """Relative L2 error ||x - deq(q(x))|| / ||x|| of keys and of values over the sampled groups."""

    key_ratio: float
    value_ratio: float


class QuantizationErrorEstimator:
    """Samples hot KV groups and measures their INT4 KIVI round-trip error, cached between scrapes."""

    def __init__(
        self,
        hot: HotTier,
        group_size: int,
        num_samples: int = DEFAULT_NUM_SAMPLES,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
    ) -> None:
        self.hot = hot
        self.group_size = group_size
        self.num_samples = num_samples
        self.min_interval_s = min_interval_s
        self._last: QuantizationError | None = None
        self._last_s = -float("inf")
        self._lock = threading.Lock()
        self._random = random.Random(0)

    def estimate(self) -> QuantizationError | None:
        """The latest estimate, refreshed when it is older than `min_interval_s`; None before any KV."""
        with self._lock:
            if time.monotonic() - self._last_s >= self.min_interval_s:
                fresh = self._measure()
                if fresh is not None:
                    self._last, self._last_s = fresh, time.monotonic()
            return self._last

    def _measure(self) -> QuantizationError | None:
        starts = self._sample_group_starts()
        if not starts:
            return None
        blocks_per_group = self.group_size // self.hot.block_size
        index = torch.tensor(
            [start + i for start in starts for i in range(blocks_per_group)], device=self.hot.keys.device
        )
        shape = (len(starts), self.group_size, *self.hot.keys.shape[-2:])
        keys = self.hot.keys[-1, index].reshape(shape).float()  # [n, G, KVH, D]
        values = self.hot.values[-1, index].reshape(shape).float()  # [n, G, KVH, D]
        return QuantizationError(_key_error(keys), _value_error(values, self.group_size))

    def _sample_group_starts(self) -> list[int]:
        """First block ids of runs of `G / BS` held blocks (ids in a run need not belong to one request)."""
        blocks_per_group = self.group_size // self.hot.block_size
        held = {b.block_id for b in list(self.hot.pool.blocks) if b.ref_count > 0}
        starts = [b for b in sorted(held) if all(b + i in held for i in range(blocks_per_group))]
        return self._random.sample(starts, min(self.num_samples, len(starts)))


def _key_error(keys: torch.Tensor) -> float:
    """`[n, G, KVH, D]` keys through per-channel INT4 and back."""
    quantized = [kivi.quantize_keys(group) for group in keys]
    codes = torch.stack([q.codes for q in quantized])
    scale = torch.stack([q.scale for q in quantized])
    zero = torch.stack([q.zero for q in quantized])
    return _relative_error(keys, kivi.dequantize_keys(codes, scale, zero))


def _value_error(values: torch.Tensor, group_size: int) -> float:
    """`[n, G, KVH, D]` values through per-token INT4 and back."""
    quantized = [kivi.quantize_values(group, group_size) for group in values]
    codes = torch.stack([q.codes for q in quantized])
    scale = torch.stack([q.scale for q in quantized])
    zero = torch.stack([q.zero for q in quantized])
    return _relative_error(values, kivi.dequantize_values(codes, scale, zero))


def _relative_error(original: torch.Tensor, restored: torch.Tensor) -> float:
    norm = original.norm()
    return float((original - restored).norm() / norm) if float(norm) > 0 else 0.0
