"""bench/lm_blocks.py: our forward of a Llama's first blocks against transformers' own, its LoRA
factors against the same change folded into the weights, and bench/safety_lm_finetune.py's GGUF
dequantizers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.lm_blocks import PROJECTIONS, LlamaBlocks, LlamaShape, padded


def read_gguf_blocks(path: Path, num_blocks: int) -> tuple[LlamaShape, dict[str, torch.Tensor]]:
    """The shape and the fp32 tensors `embed`, `<b>.attn_norm`, `<b>.ffn_norm`, `<b>.<proj>`
    (`[out, in]`, Q and K in half-split RoPE order) of the first `num_blocks` blocks, read by the
    engine's own GGUF loader."""
    from gguf import GGUFReader

    from services.engine.model.gguf.loader import BLOCK_PATTERN, gguf_model_config, iter_gguf_tensors
    from services.engine.model.gguf.metadata import GGUFMetadata

    reader = GGUFReader(str(path))
    config = gguf_model_config(GGUFMetadata(reader))
    shape = LlamaShape(
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        eps=config.rms_norm_eps,
    )
    if config.rope_scaling.rope_type not in ("default", "linear") or config.rope_scaling.factor != 1.0:
        raise ValueError(f"{path.name}: scaled RoPE is not supported here")
    if num_blocks > config.num_layers:
        raise ValueError(f"{num_blocks} blocks asked for; {path.name} has {config.num_layers}")
    short = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm"} | {g: p for p, g in PROJECTIONS.items()}

    def ours(gguf_name: str) -> str | None:
        if gguf_name == "token_embd.weight":
            return "embed"
        match = BLOCK_PATTERN.fullmatch(gguf_name)
        if match is None or int(match.group(1)) >= num_blocks or match.group(2) not in short:
            return None
        return f"{match.group(1)}.{short[match.group(2)]}"

    chosen = [t for t in reader.tensors if ours(t.name) is not None]
    tensors = {
        str(ours(t.name)): weight
        for t, (_, weight) in zip(chosen, iter_gguf_tensors(chosen, config), strict=True)
    }
    expected = 1 + num_blocks * (2 + len(PROJECTIONS))
    if len(tensors) != expected:
        raise ValueError(f"{path.name} has {len(tensors)} of the {expected} tensors of {num_blocks} blocks")
    return shape, tensors


@pytest.mark.parametrize("num_blocks", [1, 3])
def test_our_blocks_match_transformers_llama_on_the_same_gguf(
    stories_gguf: Path, stories_hf_dir: Path, num_blocks: int
) -> None:
    """stories260K (a trained Llama) read from its GGUF file: after `num_blocks` blocks our
    residual stream equals transformers' hidden state on the model's safetensors copy, for
    right-padded rows of two lengths."""
    from transformers import AutoModelForCausalLM

    shape, tensors = read_gguf_blocks(stories_gguf, num_blocks)
    ours = LlamaBlocks(shape, tensors, num_blocks)
    reference = AutoModelForCausalLM.from_pretrained(stories_hf_dir)  # the same weights
    reference.eval()
    rows = [[1, 5, 9, 23, 42, 7, 300, 11], [1, 17, 4]]
    ids, lengths = padded(rows)
    assert lengths.tolist() == [8, 3]
    with torch.no_grad():
        got = ours(ids)
        for j, row in enumerate(rows):
            want = reference.model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(got[j, : len(row)], want[num_blocks][0], atol=1e-4, rtol=1e-4)


def test_lora_factors_change_the_states_as_the_same_change_to_the_weights_does(stories_gguf: Path) -> None:
    """The factors are applied beside the frozen weights in training: the states equal those of
    the blocks whose weights carry `W + (alpha / r) * B @ A`, and differ from the frozen ones."""
    shape, tensors = read_gguf_blocks(stories_gguf, 2)
    adapted = LlamaBlocks(shape, tensors, 2, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, factor in adapted.lora.items():
            if name.endswith("_b"):
                factor.copy_(torch.randn_like(factor) * 0.05)
    folded = dict(tensors)
    for b in range(2):
        for p in PROJECTIONS:
            a, up = adapted.lora[f"{b}_{p}_a"], adapted.lora[f"{b}_{p}_b"]
            folded[f"{b}.{p}"] = tensors[f"{b}.{p}"] + 2.0 * (up @ a).detach()
    ids, _ = padded([[1, 5, 9, 23, 42]])
    with torch.no_grad():
        changed = adapted(ids)
        torch.testing.assert_close(LlamaBlocks(shape, folded, 2)(ids), changed, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(LlamaBlocks(shape, tensors, 2)(ids), changed, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F32"])
def test_the_benchs_dequantizers_match_gguf(qtype: str) -> None:
    """The GPU run rebuilds the trunk from raw GGUF blocks without the gguf package."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from bench.safety_lm_finetune import dequantize as ours

    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    raw = quantize(values, kind)
    torch.testing.assert_close(
        ours(raw, int(kind), (6, 64)), torch.from_numpy(dequantize(raw, kind).reshape(6, 64))
    )
