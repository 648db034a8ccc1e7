"""A checkpoint opened for loading: config, tokenizer and a lazy stream of named weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from services.engine import weights
from services.engine.model_config import ModelConfig
from services.engine.tokenizer import Tokenizer
from services.engine.weights import CheckpointError

TensorStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to build a model: the architecture, the tokenizer and the weights."""

    model_id: str
    config: ModelConfig
    tokenizer: Tokenizer
    tensors: TensorStream  # yields (our parameter name, tensor in [out, in] layout)
    num_tensors: int


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF directory or a `.gguf` file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from services.engine.gguf_loader import open_gguf

        return open_gguf(path)
    if weights.is_hf_dir(path):
        return _open_hf_dir(path)
    raise CheckpointError(f"{path} is neither a .gguf file nor a directory with config.json")


def _open_hf_dir(path: Path) -> Checkpoint:
    if not (path / "tokenizer.json").exists():
        raise CheckpointError(f"{path} has no tokenizer.json (the `tokenizers` fast format is required)")
    return Checkpoint(
        model_id=path.name,
        config=weights.read_hf_config(path),
        tokenizer=Tokenizer.from_hf_dir(path),
        tensors=partial(weights.iter_hf_tensors, path),
        num_tensors=len(weights.hf_tensor_names(path)),
    )
