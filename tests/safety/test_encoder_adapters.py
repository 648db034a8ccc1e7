"""Encoder adapters: merged into the weights they equal the adapted layers run as LoRA, and a gate
file that carries them loads, embeds with them and scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from services.common.gate_file import PROMPT_HEAD, GateFileError, load_gate, write_gate
from services.safety.classifier import TextClassifier
from services.safety.config import DEFAULT_GATE
from services.safety.embedder import HIDDEN, NUM_LAYERS, EmbedderSpec, MiniLMEmbedder, default_model_dir
from services.safety.encoder_adapters import ADAPTERS_KEY, EncoderAdapters
from tools.finetune_safety_encoder import adapted_layers

VOCAB = 200  # token ids of the random-weight tests stay below it


def random_encoder(seed: int = 0) -> dict[str, torch.Tensor]:
    """MiniLM-shaped random weights with a small vocabulary."""
    g = torch.Generator().manual_seed(seed)
    w = {
        "embeddings.word_embeddings.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "embeddings.position_embeddings.weight": torch.randn(512, HIDDEN, generator=g),
        "embeddings.token_type_embeddings.weight": torch.randn(2, HIDDEN, generator=g),
        "embeddings.LayerNorm.weight": torch.ones(HIDDEN),
        "embeddings.LayerNorm.bias": torch.zeros(HIDDEN),
    }
    shapes = {
        "attention.self.query": (HIDDEN, HIDDEN),
        "attention.self.key": (HIDDEN, HIDDEN),
        "attention.self.value": (HIDDEN, HIDDEN),
        "attention.output.dense": (HIDDEN, HIDDEN),
        "intermediate.dense": (4 * HIDDEN, HIDDEN),
        "output.dense": (HIDDEN, 4 * HIDDEN),
    }
    for i in range(NUM_LAYERS):
        p = f"encoder.layer.{i}."
        for name, (out_features, in_features) in shapes.items():
            w[p + name + ".weight"] = torch.randn(out_features, in_features, generator=g) / in_features**0.5
            w[p + name + ".bias"] = torch.randn(out_features, generator=g) * 0.1
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + norm + ".weight"], w[p + norm + ".bias"] = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    return w


def random_adapters(weights: dict[str, torch.Tensor], layers: list[str], rank: int = 4) -> EncoderAdapters:
    """Adapters with both factors random (trained ones have `b` away from zero)."""
    g = torch.Generator().manual_seed(1)
    a = {n: torch.randn(rank, weights[f"{n}.weight"].shape[1], generator=g) * 0.05 for n in layers}
    b = {n: torch.randn(weights[f"{n}.weight"].shape[0], rank, generator=g) * 0.05 for n in layers}
    return EncoderAdapters(rank, 8.0, a, b)


class LoraEmbedder(MiniLMEmbedder):
    """The reference: base weights, and each adapted layer run as `x W^T + b + s (x A^T) B^T`."""

    def __init__(self, weights, tokenizer, adapters: EncoderAdapters) -> None:
        super().__init__(weights, tokenizer, EmbedderSpec())
        self.adapters = adapters

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = super()._linear(x, name)
        if name in self.adapters.a:
            out = out + self.adapters.scale * F.linear(
                F.linear(x, self.adapters.a[name]), self.adapters.b[name]
            )
        return out


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))


def test_merged_weights_embed_as_the_adapted_layers_run(tokenizer: Tokenizer) -> None:
    weights = random_encoder()
    adapters = random_adapters(weights, adapted_layers(["attention", "ffn"]))
    rows = [[101, 7, 42, 199, 102], [101, 5, 102]]
    merged = MiniLMEmbedder(adapters.merged(weights), tokenizer, EmbedderSpec()).embed_windows(rows)
    reference = LoraEmbedder(weights, tokenizer, adapters).embed_windows(rows)
    base = MiniLMEmbedder(weights, tokenizer, EmbedderSpec()).embed_windows(rows)
    torch.testing.assert_close(merged, reference, atol=1e-5, rtol=1e-4)
    assert (merged - base).abs().max() > 1e-2  # the adapters change the embedding


def test_fresh_adapters_leave_the_encoder_unchanged() -> None:
    weights = random_encoder()
    adapters = EncoderAdapters.initial(weights, adapted_layers(["attention"]), rank=4, alpha=8.0)
    merged = adapters.merged(weights)
    assert all(torch.equal(merged[k], weights[k]) for k in weights)
    assert len(adapters.parameters()) == 2 * 4 * NUM_LAYERS and all(
        p.requires_grad for p in adapters.parameters()
    )


def adapted_gate(path: Path, adapters: EncoderAdapters) -> Path:
    """The shipped gate's heads (without its own adapters) plus `adapters`, written at `path`."""
    shipped = load_gate(DEFAULT_GATE)
    manifest = {k: v for k, v in shipped.manifest.raw.items() if k not in ("sha256", "format", ADAPTERS_KEY)}
    tensors = {k: v for k, v in shipped.tensors.items() if not k.startswith("encoder_lora.")}
    manifest[ADAPTERS_KEY] = adapters.manifest_entry()
    write_gate(path, tensors | adapters.tensors(), manifest)
    return path


def test_a_gate_with_adapters_loads_embeds_through_them_and_scores(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    base = MiniLMEmbedder.load()
    adapters = random_adapters(base.w, adapted_layers(["ffn"]), rank=2)
    gate = load_gate(adapted_gate(tmp_path / "gate.safetensors", adapters))
    loaded = EncoderAdapters.from_gate(gate)
    assert loaded is not None and loaded.layers == adapters.layers and loaded.rank == 2
    embedder = MiniLMEmbedder.for_gate(gate)
    rows = [embedder.text_windows("How do I bake sourdough bread at home?")[0]]
    reference = LoraEmbedder(base.w, tokenizer, adapters).embed_windows(rows)
    torch.testing.assert_close(embedder.embed_windows(rows), reference, atol=1e-5, rtol=1e-4)
    assert (embedder.embed_windows(rows) - base.embed_windows(rows)).abs().max() > 1e-3
    scores = TextClassifier(gate, embedder, max_windows=64).score("How do I bake sourdough bread at home?")
    assert set(gate.manifest.categories) <= set(scores.values)
    assert all(0.0 <= v <= 1.0 for v in scores.values.values())
    assert gate.head_weights(PROMPT_HEAD).weight.shape[1] == HIDDEN


def test_a_gate_missing_an_adapter_tensor_is_refused(tmp_path: Path) -> None:
    base = MiniLMEmbedder.load()
    adapters = random_adapters(base.w, adapted_layers(["ffn"]), rank=2)
    path = adapted_gate(tmp_path / "gate.safetensors", adapters)
    gate = load_gate(path)
    manifest = {k: v for k, v in gate.manifest.raw.items() if k not in ("sha256", "format")}
    dropped = f"encoder_lora.{adapters.layers[0]}.b"
    write_gate(path, {k: v for k, v in gate.tensors.items() if k != dropped}, manifest)
    with pytest.raises(GateFileError, match="adapter tensor"):
        EncoderAdapters.from_gate(load_gate(path))


def test_adapters_of_the_wrong_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 4"):
        EncoderAdapters(4, 8.0, {"x": torch.zeros(2, 8)}, {"x": torch.zeros(8, 2)})
