"""A checkpoint opened for loading: config, tokenizer and a lazy stream of named weights.

Only the type lives here; `services/engine/model/loader.py` opens HF directories and GGUF files into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from services.engine.model.config import ModelConfig
from services.engine.text.tokenizer import Tokenizer

TensorStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to build a model: the architecture, the tokenizer and the weights."""

    model_id: str
    config: ModelConfig
    tokenizer: Tokenizer
    tensors: TensorStream  # yields (our parameter name, tensor in [out, in] layout)
    num_tensors: int
