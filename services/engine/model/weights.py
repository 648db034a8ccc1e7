"""Hugging Face checkpoints: config.json plus one or many `*.safetensors` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or holds tensors this model does not expect."""


def is_hf_dir(path: Path) -> bool:
    """True for a directory holding config.json."""
    return path.is_dir() and (path / "config.json").exists()


def read_hf_config(path: Path) -> ModelConfig:
    """Parse `config.json` into a ModelConfig."""
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text(encoding="utf-8")))


def safetensors_files(path: Path) -> list[Path]:
    """The shard files in load order: from the index when sharded, else the single file."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no {SINGLE_FILE}, no {INDEX_FILE} and no *.safetensors")
    return files


def hf_tensor_names(path: Path) -> list[str]:
    """Our parameter names of every tensor in the checkpoint."""
    names = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            names += [our_name(n) for n in f.keys() if not n.endswith(IGNORED_SUFFIXES)]  # noqa: SIM118
    return names


def iter_hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our parameter name, tensor) for every weight, one shard open at a time."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if not name.endswith(IGNORED_SUFFIXES):
                    yield our_name(name), f.get_tensor(name)


def our_name(hf_name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight` (lm_head is unchanged)."""
    return hf_name.removeprefix("model.")
