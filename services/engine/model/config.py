"""Architecture of a Llama-family decoder, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedModel(ValueError):
    """A checkpoint this engine cannot run (wrong architecture or an unsupported option)."""


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the trained context ("default" means not at all)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()  # GGUF `rope_freqs.weight`: inv_freq is divided by these

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModel(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.factor <= 0:
            raise UnsupportedModel(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise UnsupportedModel(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.rope_type == "freq_factors" and not self.freq_factors:
            raise UnsupportedModel("rope type 'freq_factors' needs a non-empty freq_factors tuple")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama decoder: RMSNorm, RoPE, GQA, SwiGLU, no biases."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UnsupportedModel(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the fields of a Hugging Face `config.json` (transformers 4.x or 5.x layout)."""
        _check_hf_architecture(hf)
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_rope_theta(hf),
            rope_scaling=_hf_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def _check_hf_architecture(hf: dict[str, Any]) -> None:
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; this engine runs 'llama' models")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UnsupportedModel(f"{flag}=true is not supported (Llama without biases only)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")


def _hf_rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_scaling` + `rope_theta`
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    return float(_hf_rope_dict(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _hf_rope_scaling(hf: dict[str, Any]) -> RopeScaling:
    rope = _hf_rope_dict(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )
