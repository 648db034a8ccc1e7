"""Megatron-style tensor parallelism: which weights each rank holds, and the one collective it needs.

Attention is split by heads (q/k/v column-parallel, each rank a contiguous run of query heads and
the KV heads they read; o row-parallel) and the MLP by its intermediate width (gate/up
column-parallel, down row-parallel). Each block then ends in one all-reduce of `[B, S, E]`.
Embeddings, norms and the LM head stay whole on every rank: they are a small share of a Llama's
bytes, and keeping them whole means only rank 0 needs the logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.engine.model.config import ModelConfig

# weight-name suffix -> the dim split across ranks
# (0: output rows, column-parallel; 1: input columns, row-parallel)
SHARDED_DIMS = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
}


class TensorParallelError(ValueError):
    """A model or machine that cannot be split the way the `tp` setting asks."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group; the default is a single rank (no collectives)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None means the default group

    @property
    def is_parallel(self) -> bool:
        """More than one rank."""
        return self.size > 1

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs across ranks, in place."""
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (the whole tensor if it is replicated)."""
        dim = sharded_dim(name)
        if dim is None or self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank]


SINGLE = TensorParallel()


def sharded_dim(name: str) -> int | None:
    """The dim of `name` split across ranks, or None when every rank holds it whole."""
    for suffix, dim in SHARDED_DIMS.items():
        if name.endswith(suffix):
            return dim
    return None


def check_divisible(config: ModelConfig, tp_size: int) -> None:
    """Raise with the model's shapes when `tp_size` ranks cannot split it evenly."""
    if tp_size < 1:
        raise TensorParallelError(f"tp must be >= 1, got {tp_size}")
    shapes = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    uneven = {name: value for name, value in shapes.items() if value % tp_size}
    if uneven:
        fits = [n for n in range(1, config.num_kv_heads + 1) if all(v % n == 0 for v in shapes.values())]
        raise TensorParallelError(
            f"tp={tp_size} does not divide this model's {uneven}; tp must divide the KV heads, "
            f"query heads and MLP width: use one of {fits}"
        )


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The per-rank shapes: heads, KV heads and MLP width divided by `tp_size` (hidden size whole)."""
    check_divisible(config, tp_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp_size,
        num_kv_heads=config.num_kv_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
    )
