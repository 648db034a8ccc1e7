"""The gate's second encoder: the first blocks of the language model the engine serves.

A gate with an `lm_prompt_head` manifest entry scores the harm categories of prompts with the
first `blocks` transformer blocks of SmolLM2-135M-Instruct (the engine's default model, from its
pinned PyPI wheel, sha256 checked by services/engine/model/registry.py), adapted by LoRA factors
stored in the gate, and a head over the state at the position where the model would start its
answer: the text goes in as a user turn of the model's chat format, so that position is where an
instruct model decides whether to refuse. The head is the gate's usual softmax over benign + the
categories (services/common/gate_file.py `gate_scores`), after an RMSNorm with its own weight.

A text longer than one window (`max_tokens`, chat frame included) is scored in windows of that
size at half-window strides, each framed as a turn of its own; a category's score is its highest
over windows. The forward is written here (a Llama block: RMSNorm, rotary attention with grouped
KV heads, SwiGLU) rather than borrowed from the engine, whose paged runtime serves decode; both
read the same GGUF file, and tests/safety/test_lm_encoder.py holds this one to transformers' Llama.

Tensors: `lm.lora.<block>.<proj>.a` `[r, in]` / `.b` `[out, r]`, `lm.norm` `[H]`, and the head
`lm_prompt_head.weight` `[C + 1, H]` / `.bias`. The manifest entry gives the model, its sha256,
`blocks`, `max_tokens`, LoRA `rank` and `alpha`, and per-category `thresholds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.common.gate_file import Gate, GateFileError, HeadWeights, gate_scores

LM_HEAD = "lm_prompt_head"
LM_FORMAT = "lm_prompt_head/1"
TENSOR_PREFIX = "lm."
FRAME_HEAD = "<|im_start|>user\n"
FRAME_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
PROJECTIONS = {  # our short name -> the GGUF tensor's
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


@dataclass(frozen=True)
class LlamaShape:
    """What the forward needs of the model's configuration."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved-RoPE row order of a Q or K projection back to the half-split one."""
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def read_gguf_blocks(path: Path, num_blocks: int) -> tuple[LlamaShape, dict[str, torch.Tensor], Any]:
    """The shape, the fp32 tensors `embed`, `<b>.attn_norm`, `<b>.ffn_norm`, `<b>.<proj>` (`[out,
    in]`, Q and K in half-split RoPE order) of the first `num_blocks` blocks, and the GGUF reader
    (its tokenizer metadata)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from services.engine.model.gguf.loader import gguf_model_config
    from services.engine.model.gguf.metadata import GGUFMetadata

    reader = GGUFReader(str(path))
    config = gguf_model_config(GGUFMetadata(reader))  # the engine's reading of the same metadata
    shape = LlamaShape(
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        eps=config.rms_norm_eps,
    )
    if config.rope_scaling.rope_type not in ("default", "linear") or (
        config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor != 1.0
    ):
        raise GateFileError(f"{path.name}: scaled RoPE is not supported by the safety encoder")
    if num_blocks > config.num_layers:
        raise GateFileError(f"the gate reads {num_blocks} blocks; {path.name} has {config.num_layers}")
    wanted = {"token_embd.weight": "embed"}
    for b in range(num_blocks):
        wanted |= {f"blk.{b}.{n}.weight": f"{b}.{n}" for n in ("attn_norm", "ffn_norm")}
        wanted |= {f"blk.{b}.{g}.weight": f"{b}.{p}" for p, g in PROJECTIONS.items()}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name not in wanted:
            continue
        values = dequantize(tensor.data, tensor.tensor_type)
        dims = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the innermost first
        weight = torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(dims))
        name = wanted[tensor.name]
        if name.endswith(".q"):
            weight = unpermute_rope(weight, shape.heads)
        elif name.endswith(".k"):
            weight = unpermute_rope(weight, shape.kv_heads)
        tensors[name] = weight
    missing = sorted(set(wanted.values()) - set(tensors))
    if missing:
        raise GateFileError(f"{path.name} lacks tensors {missing[:4]}")
    return shape, tensors, reader


class LlamaBlocks(torch.nn.Module):
    """The embedding and first blocks of a Llama, frozen, with optional LoRA factors per projection
    (trained by tools/train_lm_prompt_head.py; merged into the weights for serving)."""

    def __init__(
        self,
        shape: LlamaShape,
        tensors: dict[str, torch.Tensor],
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
        alpha: float = 0.0,
    ) -> None:
        super().__init__()
        self.shape, self.num_blocks, self.rank = shape, num_blocks, rank
        self.scale = alpha / rank if rank else 0.0
        self.frozen = {
            name: t.to(dtype if t.dim() == 2 else torch.float32)
            for name, t in tensors.items()
            if name == "embed" or int(name.split(".")[0]) < num_blocks
        }
        self.lora = torch.nn.ParameterDict()
        if rank:
            generator = torch.Generator().manual_seed(0)
            for b in range(num_blocks):
                for p in PROJECTIONS:
                    out_features, in_features = self.frozen[f"{b}.{p}"].shape
                    a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                    self.lora[f"{b}_{p}_a"] = torch.nn.Parameter(a)
                    self.lora[f"{b}_{p}_b"] = torch.nn.Parameter(torch.zeros(out_features, rank))
        dim = shape.head_dim
        self.inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, dim, 2).float() / dim)

    def to_device(self, device: torch.device) -> LlamaBlocks:
        """Moves the frozen tensors as well as the factors."""
        self.frozen = {k: v.to(device) for k, v in self.frozen.items()}
        self.inv_freq = self.inv_freq.to(device)
        return self.to(device)

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """The factors as the gate stores them: `lm.lora.<block>.<proj>.a` / `.b`."""
        return {
            f"{TENSOR_PREFIX}lora.{b}.{p}.{side}": self.lora[f"{b}_{p}_{side}"].detach()
            for b in range(self.num_blocks)
            for p in PROJECTIONS
            for side in "ab"
        }

    def merge(self, lora: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
        """Folds stored factors (`lora_tensors()`'s names) into the frozen weights."""
        for b in range(self.num_blocks):
            for p in PROJECTIONS:
                a, bb = lora.get(f"{TENSOR_PREFIX}lora.{b}.{p}.a"), lora.get(f"{TENSOR_PREFIX}lora.{b}.{p}.b")
                if a is None or bb is None:
                    raise GateFileError(f"the gate lacks LoRA factors of block {b}'s {p} projection")
                weight = self.frozen[f"{b}.{p}"]
                delta = (alpha / rank) * (bb.float() @ a.float())
                self.frozen[f"{b}.{p}"] = (weight.float() + delta).to(weight.dtype)

    def _linear(self, x: torch.Tensor, block: int, proj: str) -> torch.Tensor:
        y = x @ self.frozen[f"{block}.{proj}"].T
        if self.rank:
            a, b = self.lora[f"{block}_{proj}_a"], self.lora[f"{block}_{proj}_b"]
            y = y + self.scale * ((x @ a.to(x.dtype).T) @ b.to(x.dtype).T)
        return y

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.shape.eps) * weight
        return normed.to(x.dtype)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[2], device=x.device).float(), self.inv_freq)
        cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream `[B, T, H]` after the blocks. Rows are right-padded: attention is
        causal, so no real position reads a pad."""
        s = self.shape
        x = self.frozen["embed"][ids]
        batch, seq, _ = x.shape
        for b in range(self.num_blocks):
            h = self._norm(x, self.frozen[f"{b}.attn_norm"])
            q = self._linear(h, b, "q").view(batch, seq, s.heads, s.head_dim).transpose(1, 2)
            k = self._linear(h, b, "k").view(batch, seq, s.kv_heads, s.head_dim).transpose(1, 2)
            v = self._linear(h, b, "v").view(batch, seq, s.kv_heads, s.head_dim).transpose(1, 2)
            group = s.heads // s.kv_heads
            k, v = self._rope(k).repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(self._rope(q), k, v, is_causal=True)
            x = x + self._linear(attn.transpose(1, 2).reshape(batch, seq, -1), b, "o")
            h = self._norm(x, self.frozen[f"{b}.ffn_norm"])
            x = x + self._linear(F.silu(self._linear(h, b, "gate")) * self._linear(h, b, "up"), b, "down")
        return x


def pooled(states: torch.Tensor, lengths: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """Each row's state at its last real position (where the answer starts), RMS-normed `[B, H]`."""
    last = states[torch.arange(len(states), device=states.device), lengths - 1].float()
    return last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight


def framed_windows(body: list[int], head: list[int], tail: list[int], max_tokens: int) -> list[list[int]]:
    """The rows one text is scored in: the whole body in the chat frame when it fits
    `max_tokens`, else windows of the body at half-window strides, each framed."""
    size = max_tokens - len(head) - len(tail)
    if size < 8:
        raise ValueError(f"max_tokens {max_tokens} leaves no room beside the chat frame")
    if len(body) <= size:
        return [head + body + tail]
    stride = size // 2
    starts = [*range(0, len(body) - size, stride), len(body) - size]
    return [head + body[s : s + size] + tail for s in starts]


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` and lengths `[B]`."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, : len(row)] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])


@dataclass(frozen=True)
class LMHeadSpec:
    """The manifest's `lm_prompt_head` entry."""

    model: str
    sha256: str
    blocks: int
    max_tokens: int
    rank: int
    alpha: float
    thresholds: dict[str, float]

    @classmethod
    def from_gate(cls, gate: Gate) -> LMHeadSpec | None:
        """The gate's entry, or None when the gate has no second encoder."""
        entry = gate.manifest.raw.get(LM_HEAD)
        if entry is None:
            return None
        if entry.get("format") != LM_FORMAT:
            raise GateFileError(
                f"gate {gate.version}: {LM_HEAD} format {entry.get('format')!r} is not {LM_FORMAT}"
            )
        try:
            spec = cls(
                model=str(entry["model"]),
                sha256=str(entry["sha256"]),
                blocks=int(entry["blocks"]),
                max_tokens=int(entry["max_tokens"]),
                rank=int(entry["rank"]),
                alpha=float(entry["alpha"]),
                thresholds={c: float(entry["thresholds"][c]) for c in gate.manifest.categories},
            )
        except (KeyError, TypeError, ValueError) as error:
            raise GateFileError(f"gate {gate.version}: {LM_HEAD} entry is incomplete ({error})") from None
        if not all(0 < t <= 1 for t in spec.thresholds.values()):
            raise GateFileError(f"gate {gate.version}: {LM_HEAD} thresholds must lie in (0, 1]")
        return spec


def load_tokenizer(reader: Any) -> Any:
    """The model's tokenizer, rebuilt from the GGUF file's metadata as the engine rebuilds it."""
    from services.engine.model.gguf.metadata import GGUFMetadata
    from services.engine.model.gguf.tokenizer import build_gguf_tokenizer

    return build_gguf_tokenizer(GGUFMetadata(reader))


class LMPromptScorer:
    """Per-category harm scores of prompts from the gate's second encoder (inference only)."""

    def __init__(
        self, spec: LMHeadSpec, blocks: LlamaBlocks, tokenizer: Any, head: HeadWeights, norm: torch.Tensor
    ):
        self.spec, self.blocks, self.tokenizer, self.head, self.norm = spec, blocks, tokenizer, head, norm
        self.frame = self.frame_ids(tokenizer)

    @staticmethod
    def frame_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
        """The chat frame's ids before and after the text."""
        return tokenizer.encode(FRAME_HEAD, add_bos=False), tokenizer.encode(FRAME_TAIL, add_bos=False)

    @classmethod
    def from_parts(
        cls,
        spec: LMHeadSpec,
        blocks: LlamaBlocks,
        tokenizer: Any,
        tensors: dict[str, torch.Tensor],
        categories: tuple[str, ...],
    ) -> LMPromptScorer:
        """A scorer over merged `blocks` and the gate's head tensors (`tensors` holds them)."""
        head = HeadWeights(
            weight=tensors[f"{LM_HEAD}.weight"].float(),
            bias=tensors[f"{LM_HEAD}.bias"].float(),
            thresholds=torch.tensor([spec.thresholds[c] for c in categories]),
        )
        return cls(spec, blocks, tokenizer, head, tensors[f"{TENSOR_PREFIX}norm"].float())

    @classmethod
    def for_gate(
        cls, gate: Gate, model_path: Path | None = None, dtype: torch.dtype | None = None
    ) -> LMPromptScorer | None:
        """The scorer `gate` asks for (None when it has no `lm_prompt_head`), its model read from
        `model_path` or fetched by the engine's registry, and checked against the gate's sha256."""
        spec = LMHeadSpec.from_gate(gate)
        if spec is None:
            return None
        from services.engine.model.registry import resolve_model, sha256_of

        path = model_path or resolve_model(spec.model)
        digest = sha256_of(path)
        if digest != spec.sha256:
            raise GateFileError(
                f"gate {gate.version} was trained on {spec.model} with sha256 {spec.sha256[:12]}..., "
                f"but {path} has {digest[:12]}...: point THERMOCLINE_SAFETY_LM_MODEL at the right file"
            )
        shape, tensors, reader = read_gguf_blocks(path, spec.blocks)
        blocks = LlamaBlocks(shape, tensors, spec.blocks, dtype or default_dtype())
        blocks.merge(gate.tensors, spec.rank, spec.alpha)
        return cls.from_parts(spec, blocks, load_tokenizer(reader), gate.tensors, gate.manifest.categories)

    def rows(self, text: str) -> list[list[int]]:
        """The framed windows `text` is scored in (its canonical form is the caller's)."""
        head, tail = self.frame
        return framed_windows(self.tokenizer.encode(text, add_bos=False), head, tail, self.spec.max_tokens)

    @torch.inference_mode()
    def scores(self, text: str) -> torch.Tensor:
        """Per-category risk `[C]`: each category's highest over the text's windows."""
        ids, lengths = padded(self.rows(text))
        states = self.blocks(ids)
        return gate_scores(pooled(states, lengths, self.norm), self.head).max(dim=0).values


def default_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 matmuls (AMX or AVX512-BF16), else fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32
