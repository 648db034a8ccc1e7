"""The cold-tier codec: what the entropy rule's thresholds cost in attention error and save in bytes,
and how fast the two implementations encode and decode.

Part 1 (thresholds). stories260K (the trained 5-layer Llama in ../shared/models) writes a story
of `--tokens` tokens from "Once upon a time" (seeded sampling, so the text is in its own
distribution); one forward pass over it records every layer's post-RoPE queries, keys and values.
Everything before the last `2 * --window` tokens is cold, in blocks of `--block` tokens. Each cold
block's token mass is the attention it drew from the `--window` queries before the last window
(what an engine has seen when it demotes the block), summed over layers and heads. The last
`--window` queries are the future: each setting's decoded cold blocks (dropped tokens masked out)
plus the exact recent tokens give an attention output, compared with exact attention as
relative L2 error, averaged over layers, heads and queries.

The default rule is the setting with the fewest bytes whose error stays within `--slack`
(default 10%) of INT2 with every token kept: sparsity may add a tenth to the quantization error.

Part 2 (speed and size). Encode and decode time of the vectorised codec against the reference, on
the CPU, for block shapes of real models; compression against BF16 from the payload layout.

    .venv/bin/python bench/kvstore_codec.py --out bench/results/kvstore_codec_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from services.common.kv_codec.codec import (
    KEEP_ALL,
    CodecSettings,
    SparsityRule,
    attention_entropy,
    bf16_bytes,
    decode_block,
    decode_block_reference,
    encode_block,
    encode_block_reference,
    read_layout,
)

MODEL_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K" / "hf"
SHAPES = {  # name: (layers, kv heads, head dim)
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3.1-8B": (32, 8, 128),
}


@dataclass(frozen=True)
class Capture:
    """One forward pass's per-layer tensors, all post-RoPE: `[L, H or KVH, S, D]`."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def capture(model_dir: Path, num_tokens: int, seed: int) -> Capture:
    """Samples a story from the model, then records q, k, v of every layer over it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(seed)
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        ids = model.generate(
            prompt,
            do_sample=True,
            max_new_tokens=num_tokens - prompt.shape[1],
            min_new_tokens=num_tokens - prompt.shape[1],
        )
    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        v = module.v_proj(hidden).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        records.append((q[0], k[0], v[0]))

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    q, k, v = (torch.stack(parts) for parts in zip(*records, strict=True))
    return Capture(q, k, v)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries at `q_positions` over keys with `mask` `[S]` (False: dropped).

    q `[L, H, Q, D]`, k and v `[L, KVH, S, D]` -> `[L, H, Q, D]`."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [L, H, Q, S]
    positions = torch.arange(k.shape[2])
    allowed = mask[None, :] & (positions[None, :] <= q_positions[:, None])  # [Q, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@dataclass(frozen=True)
class Setting:
    """One rule to measure."""

    name: str
    rule: SparsityRule


@dataclass(frozen=True)
class Outcome:
    """A setting's error and size."""

    setting: Setting
    relative_error: float
    bytes_per_token: float
    kept_share: float


def token_mass(cap: Capture, history: torch.Tensor, cold_tokens: int) -> torch.Tensor:
    """`[cold_tokens]` attention mass from the history queries, summed over layers and heads."""
    full = torch.ones(cap.keys.shape[2], dtype=torch.bool)
    groups = cap.queries.shape[1] // cap.keys.shape[1]
    k = cap.keys.repeat_interleave(groups, dim=1)
    scores = cap.queries[:, :, history] @ k.transpose(-1, -2) / math.sqrt(cap.queries.shape[-1])
    causal = torch.arange(k.shape[2])[None, :] <= history[:, None]
    probs = torch.softmax(scores.masked_fill(~(causal & full), float("-inf")), dim=-1)
    return probs.sum(dim=(0, 1, 2))[:cold_tokens]


def measure(cap: Capture, setting: Setting, block: int, window: int, group: int) -> Outcome:
    """Encodes every cold block under the setting; the future queries' attention error."""
    num_tokens = cap.keys.shape[2]
    cold_tokens = (num_tokens - 2 * window) // block * block
    history = torch.arange(num_tokens - 2 * window, num_tokens - window)
    future = torch.arange(num_tokens - window, num_tokens)
    mass = token_mass(cap, history, cold_tokens)
    keys, values = cap.keys.clone(), cap.values.clone()
    mask = torch.ones(num_tokens, dtype=torch.bool)
    payload_bytes = 0
    settings = CodecSettings(group_size=group, sparsity=setting.rule)
    for start in range(0, cold_tokens, block):
        span = slice(start, start + block)
        k_block = cap.keys[:, :, span].transpose(1, 2)  # [L, T, KVH, D]
        v_block = cap.values[:, :, span].transpose(1, 2)
        payload = encode_block(k_block.bfloat16(), v_block.bfloat16(), mass[span], settings)
        payload_bytes += len(payload)
        dense_k, dense_v = decode_block(payload).to_dense()
        keys[:, :, span], values[:, :, span] = dense_k.transpose(1, 2), dense_v.transpose(1, 2)
        mask[span] = decode_block(payload).token_mask
    q = cap.queries[:, :, future]
    exact = attention(q, cap.keys, cap.values, torch.ones(num_tokens, dtype=torch.bool), future)
    approx = attention(q, keys, values, mask, future)
    error = ((approx - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()
    return Outcome(setting, error, payload_bytes / cold_tokens, mask[:cold_tokens].float().mean().item())


def mean_outcome(per_text: list[Outcome]) -> Outcome:
    """One setting's figures averaged over the texts."""
    count = len(per_text)
    return Outcome(
        per_text[0].setting,
        sum(o.relative_error for o in per_text) / count,
        sum(o.bytes_per_token for o in per_text) / count,
        sum(o.kept_share for o in per_text) / count,
    )


def settings_grid() -> list[Setting]:
    """INT2 with every token kept, then the entropy rule over its four knobs."""
    grid = [Setting("keep all (INT2 only)", KEEP_ALL)]
    for low, high in itertools.product((0.9, 0.95, 0.97, 0.98), (0.95, 0.97, 0.99, 1.0)):
        for mid, low_keep in ((0.75, 0.5), (0.5, 0.25), (0.5, 0.125), (0.25, 0.125)):
            if low <= high:
                grid.append(
                    Setting(
                        f"low {low}, high {high}, keep {mid}/{low_keep}",
                        SparsityRule(low, high, mid, low_keep),
                    )
                )
    return grid


def pick_default(outcomes: list[Outcome], slack: float, min_kept: float) -> Outcome:
    """The fewest bytes within `slack` of the keep-all error, keeping at least `min_kept` of the tokens."""
    ceiling = outcomes[0].relative_error * (1 + slack)
    allowed = [o for o in outcomes if o.relative_error <= ceiling and o.kept_share >= min_kept]
    return min(allowed, key=lambda o: o.bytes_per_token)


def entropy_percentiles(captures: list[Capture], block: int, window: int) -> list[float]:
    """Block entropies at the 10th, 25th, 50th, 75th and 90th percentiles, over every text."""
    values = []
    for cap in captures:
        num_tokens = cap.keys.shape[2]
        cold_tokens = (num_tokens - 2 * window) // block * block
        mass = token_mass(cap, torch.arange(num_tokens - 2 * window, num_tokens - window), cold_tokens)
        values += [attention_entropy(mass[s : s + block]) for s in range(0, cold_tokens, block)]
    entropies = torch.tensor(values)
    return [torch.quantile(entropies, p).item() for p in (0.1, 0.25, 0.5, 0.75, 0.9)]


@dataclass(frozen=True)
class Speed:
    """Per-block times and sizes for one shape."""

    shape: str
    block_tokens: int
    encode_ms: float
    decode_ms: float
    reference_encode_ms: float | None
    reference_decode_ms: float | None
    ratio_keep_all: float
    ratio_half: float


def best_ms(call, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Best of `repeats` wall times after one warm-up call, in ms."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def speed(
    name: str, layers: int, heads: int, dim: int, block: int, group: int, with_reference: bool
) -> Speed:
    """Times both implementations on a random BF16 block of a model's shape."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, block, heads, dim, generator=generator).bfloat16()
    values = torch.randn(layers, block, heads, dim, generator=generator).bfloat16()
    mass = torch.rand(block, generator=generator)
    settings = CodecSettings(group_size=group, sparsity=KEEP_ALL)
    payload = encode_block(keys, values, mass, settings)
    half = encode_block(
        keys,
        values,
        torch.cat([torch.ones(block // 2), torch.zeros(block - block // 2)]),
        CodecSettings(group_size=group, sparsity=SparsityRule(0.99, 0.99, 0.5, 0.5)),
    )
    layout = read_layout(payload)
    ref_encode = ref_decode = None
    if with_reference:
        ref_encode = best_ms(lambda: encode_block_reference(keys, values, mass, settings), 1)
        ref_decode = best_ms(lambda: decode_block_reference(payload), 1)
    return Speed(
        name,
        block,
        best_ms(lambda: encode_block(keys, values, mass, settings), 10),
        best_ms(lambda: decode_block(payload), 10),
        ref_encode,
        ref_decode,
        bf16_bytes(layout) / len(payload),
        bf16_bytes(layout) / len(half),
    )


def environment() -> dict[str, str]:
    """Date, commit and machine for the results header."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "services/kvstore", "bench/kvstore_codec.py"],
            capture_output=True,
            text=True,
        ).stdout
        commit += " (kvstore files modified)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = cpu_name()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "hardware": f"CPU {cpu}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}",
        "versions": f"torch {torch.__version__}, Python {platform.python_version()}",
    }


def to_markdown(
    args: argparse.Namespace,
    env: dict[str, str],
    outcomes: list[Outcome],
    chosen: Outcome,
    unbounded: Outcome,
    entropies: list[float],
    speeds: list[Speed],
) -> str:
    """The results file."""
    base = outcomes[0]
    seeds = " ".join(map(str, args.seeds))
    lines = [
        "# kvstore codec: entropy-rule thresholds, speed and size",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}; {env['versions']}",
        f"- model: stories260K (`{MODEL_DIR.relative_to(MODEL_DIR.parents[3])}`: 5 layers, 8 query heads, "
        "4 kv heads, head dim 8), fp32, keys/values rounded to BF16 before encoding",
        f"- text: {len(args.seeds)} stories of {args.tokens} tokens the model sampled from "
        f"'Once upon a time' (seeds {seeds}); figures are means over them",
        f"- settings: block {args.block} tokens, group size {args.group}, fp16 scales; history window "
        f"{args.window} queries set each cold token's mass, the last {args.window} queries are scored",
        "- error: relative L2 error of the attention output over cold (decoded) + recent (exact) "
        "tokens against exact attention, mean over layers, heads and scored queries",
        f"- choice (the default): fewest bytes with error <= (1 + {args.slack}) x the keep-all error "
        f"({base.relative_error:.4f}) keeping at least {args.min_kept:.0%} of the tokens, because a 5-layer "
        "model over 512 tokens says little about the rare, far tokens a long context needs; without that "
        f"floor the choice would be `{unbounded.setting.name}` ({unbounded.kept_share:.0%} kept, error "
        f"{unbounded.relative_error:.4f}, {unbounded.bytes_per_token:.1f} B/token)",
        f"- reproduce: `.venv/bin/python bench/kvstore_codec.py --tokens {args.tokens} --block {args.block} "
        f"--window {args.window} --group {args.group} --slack {args.slack} --min-kept {args.min_kept} "
        f"--seeds {seeds}`",
        "",
        "Block entropy of this text (10th/25th/50th/75th/90th percentile): "
        + ", ".join(f"{e:.3f}" for e in entropies),
        "",
        "## Thresholds",
        "",
        "| setting | kept tokens | attention error | vs keep-all | bytes per cold token | vs BF16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    bf16_per_token = 2 * 5 * 4 * 8 * 2
    for o in outcomes:
        mark = " **(default)**" if o is chosen else ""
        lines.append(
            f"| {o.setting.name}{mark} | {o.kept_share:.1%} | {o.relative_error:.4f} | "
            f"{o.relative_error / base.relative_error:.2f}x | {o.bytes_per_token:.1f} | "
            f"{bf16_per_token / o.bytes_per_token:.2f}x |"
        )
    lines += [
        "",
        f"BF16 holds a token of this model in {bf16_per_token} B "
        "(keys and values, 5 layers x 4 kv heads x 8). "
        "Head dim 8 makes each value scale cover only 8 values, so the ratios here are lower than for "
        "the shapes below.",
        "",
        "## Speed and size (random BF16 blocks, every token kept unless noted)",
        "",
        "Times are the best of 10 calls after a warm-up, on the CPU of a 2-core machine that other "
        "jobs share: read them as orders of magnitude. The engine encodes and decodes on its GPU.",
        "",
        "| shape (layers, kv heads, head dim) | block tokens | encode ms | decode ms | reference encode ms "
        "| reference decode ms | vs BF16, all kept | vs BF16, half kept |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in speeds:
        ref_e = f"{s.reference_encode_ms:,.0f}" if s.reference_encode_ms is not None else "—"
        ref_d = f"{s.reference_decode_ms:,.0f}" if s.reference_decode_ms is not None else "—"
        layers, heads, dim = SHAPES[s.shape]
        lines.append(
            f"| {s.shape} ({layers}, {heads}, {dim}) | {s.block_tokens} | {s.encode_ms:.2f} "
            f"| {s.decode_ms:.2f} "
            f"| {ref_e} | {ref_d} | {s.ratio_keep_all:.2f}x | {s.ratio_half:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--slack", type=float, default=0.10)
    parser.add_argument("--min-kept", type=float, default=0.5, help="least share of tokens the default keeps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    captures = [capture(args.model_dir, args.tokens, seed) for seed in args.seeds]
    outcomes = []
    for setting in settings_grid():
        outcomes.append(
            mean_outcome([measure(c, setting, args.block, args.window, args.group) for c in captures])
        )
        o = outcomes[-1]
        print(
            f"{setting.name:<40} kept {o.kept_share:6.1%} error {o.relative_error:.4f} "
            f"{o.bytes_per_token:7.1f} B/token",
            flush=True,
        )
    chosen = pick_default(outcomes, args.slack, args.min_kept)
    unbounded = pick_default(outcomes, args.slack, 0.0)
    speeds = []
    for name, (layers, heads, dim) in SHAPES.items():
        for block in (16, 64):
            speeds.append(
                speed(
                    name,
                    layers,
                    heads,
                    dim,
                    block,
                    args.group,
                    with_reference=name == "SmolLM2-135M" and block == 16,
                )
            )
            print(speeds[-1], flush=True)
    markdown = to_markdown(
        args,
        environment(),
        outcomes,
        chosen,
        unbounded,
        entropy_percentiles(captures, args.block, args.window),
        speeds,
    )
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")
    print(markdown)


if __name__ == "__main__":
    main()
