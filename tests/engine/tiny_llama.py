"""Factory for tiny random Llama checkpoints written by transformers itself (the reference)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Once upon a time there was a little robot who loved to count numbers: 1, 2, 3, 42.",
    "The quick brown fox jumps over the lazy dog. Naïve café owners sell crème brûlée!",
    "Thermocline serves language models over gRPC with a tiered key value cache.",
    "Привет, мир! 你好，世界。 Emoji: 🙂🚀 and tabs\tand\nnewlines.",
]
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape options for a tiny Llama; defaults exercise GQA and llama3 RoPE scaling."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    llama3_rope: bool = True
    max_shard_size: str | None = None  # e.g. "40KB" to force model-0000x-of-0000y shards
    seed: int = 0


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a fixed corpus, with BOS/EOS and chat markers as special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def hf_config_kwargs(spec: TinySpec, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments for transformers' LlamaConfig."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }


def make_tiny_llama(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write config.json, safetensors (sharded if asked), tokenizer.json and tokenizer_config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(spec.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(spec, vocab_size)))
    _spread_weights(model)
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save(str(path / "tokenizer.json"))
    _write_tokenizer_config(path)
    return path


def _spread_weights(model: torch.nn.Module) -> None:
    # default init (std 0.02) makes near-uniform logits, where argmax ties hide bugs
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.15)


def _write_tokenizer_config(path: Path) -> None:
    import json

    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
