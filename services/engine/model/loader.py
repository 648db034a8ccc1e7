"""Open a checkpoint (an HF directory or a `.gguf` file), build a LlamaModel on a device and fill it
from the checkpoint's weight stream."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from services.engine.model import weights
from services.engine.model.checkpoint import Checkpoint
from services.engine.model.gguf.loader import open_gguf
from services.engine.model.llama import LlamaModel
from services.engine.model.tensor_parallel import SINGLE, TensorParallel
from services.engine.model.weights import CheckpointError
from services.engine.text.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported)."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    progress: bool = True,
    tp: TensorParallel = SINGLE,
) -> LlamaModel:
    """Allocate the model uninitialized on `device`, copy every weight in, and check none is missing.

    Under tensor parallelism every rank reads the whole checkpoint and keeps its own slices.
    """
    with torch.device("meta"):
        model = LlamaModel(checkpoint.config, max_positions=max_positions, tp=tp)
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    model.rotary.reset()
    _copy_weights(model, checkpoint, progress, tp)
    return model.eval().requires_grad_(False)


def _copy_weights(model: LlamaModel, checkpoint: Checkpoint, progress: bool, tp: TensorParallel) -> None:
    expected = model.checkpoint_names()
    if checkpoint.config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # shares embed_tokens.weight
    loaded: set[str] = set()
    stream = tqdm(
        checkpoint.tensors(),
        total=checkpoint.num_tensors,
        desc=f"loading {checkpoint.model_id}" + (f" (rank {tp.rank}/{tp.size})" if tp.is_parallel else ""),
        unit="tensor",
        disable=not progress,
    )
    with torch.no_grad():
        for name, tensor in stream:
            if name == "lm_head.weight" and checkpoint.config.tie_word_embeddings:
                continue
            _copy_one(model, name, tp.shard(name, tensor))
            loaded.add(name)
    missing = expected - loaded
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint.model_id} lacks weights: {sorted(missing)[:8]}")


def _copy_one(model: LlamaModel, name: str, tensor: torch.Tensor) -> None:
    try:
        target = model.weight_slot(name)
    except AttributeError:  # torch's get_parameter/get_submodule raise AttributeError for unknown names
        raise CheckpointError(f"unexpected weight {name!r} in checkpoint") from None
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF directory or a `.gguf` file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
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
