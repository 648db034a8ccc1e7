"""The fused paged-attention kernel alone: one decode launch over long contexts, hot only and INT4 warm,
and (`--prefill`) one chunk of prefill over a long cached prefix.

Random caches in the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128, block 16,
warm group 32); every row's context is sink + warm + a 128-token hot window (tiers on) or all hot
(tiers off). Times `paged_attention` (with its flash-decoding merge) per layer call, 20 calls
captured in one CUDA graph as the engine's decode runs them, and reports the
bytes it must read against the measured copy bandwidth. Needs CUDA. A launch variant
`TILExWARPS[xSTAGES[xREGS[xUNROLL[xROWS[xBRANCHFREE[xSPLIT]]]]]]` overrides the kernel's launch shape
(tile positions, warps, software-pipeline stages, register cap, warm-loop unrolling, (token, head)
rows a program, 1 for the one-warp decode's branch-free rescale, 1 for a prefill's causal compare on
diagonal tiles only; a 0 keeps that field's default), so one run can compare them; "default" is what
the engine launches (for a prefill, triton_backend's PREFILL_LAUNCH, or PREFIX_PAGES_LAUNCH on the
pages path; `64x4` is the kernel's own default). With `--prefix-pages` the variants apply to the pages
path too, and `--dense` adds the backend's dense prefill path (library attention, dense_prefill.py)
over the pages and with the tiers off, compared with the kernel's default launch of the same path.
Every variant's output is compared with the default launch's on the same caches and queries (the "vs default"
column: the largest absolute difference), and a prefill's row shows its attention TFLOP/s (the causal
products it must do: 4 x head dim x query heads x the positions each new token sees).

    python bench/attention_kernel.py --contexts 1024,32768 --batches 1,16
    python bench/attention_kernel.py --contexts 16384 --batches 1 --prefill 2048 --prefix-pages

With `--prefill N`, each row's last N tokens are the new queries (a prefill chunk, hot) and the
context before them is the cached prefix (warm past the sink with the tiers on); `--prefix-pages`
adds the engine's prefill path, where the backend first dequantizes that prefix into pages of the
hot layout (the "warm prefix as pages" row, dequantization included in its time).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.attention.metadata import AttentionMetadata, HostMetadata, RowInput
from services.engine.attention.paged_kernels import Partials, paged_attention
from services.engine.attention.triton_backend import PREFILL_LAUNCH, PREFIX_PAGES_LAUNCH, TritonBackend
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 128, 16, 1
TIERS = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=1 << 20, group_size=32)


def time_decode(
    batch: int,
    context: int,
    tiered: bool,
    tile_n: int | None = None,
    num_warps: int | None = None,
    segments: int | None = None,
    prefill: int = 0,
    pages: bool = False,
    dense: bool = False,
    **launch,
) -> tuple[float, float, int, torch.Tensor]:
    """(µs per call, bytes the call must read, flash-decoding segments, the output); `prefill` > 0
    times a chunk of that many new tokens per row after `context` cached ones instead of one decode
    token; `pages` times the engine's prefill path instead: the backend dequantizes the warm prefix
    into pages of the hot layout (each call, as each layer of a step does), then the kernel reads them
    as hot; `dense` times the backend's dense prefill path (dense_prefill: library attention over the
    same pages and hot blocks) instead of the kernel."""
    torch.manual_seed(0)  # the same caches and queries for every launch variant, to compare outputs
    config = ModelConfig(vocab_size=8, hidden_size=HEADS * DIM, intermediate_size=8, num_layers=LAYERS,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)  # fmt: skip
    tiers = TIERS if tiered else TierConfig()
    new_tokens = max(prefill, 1)
    total = context + new_tokens - 1 if prefill == 0 else context + prefill
    blocks = batch * (-(-total // BLOCK) + 2) + 1
    hot = HotTier(config, blocks, BLOCK, torch.device("cuda"), torch.bfloat16)
    hot.keys.normal_()
    hot.values.normal_()
    warm = WarmTier(config, batch * (total // TIERS.group_size + 1), TIERS.group_size, torch.device("cuda"))
    for t in (warm.key_codes, warm.value_codes):
        t.random_(0, 256)
    for t in (warm.key_scale, warm.value_scale):
        t.fill_(0.01)
    cache = KVCache(hot, warm if tiered else None)
    tables = []
    for _ in range(batch):
        table = BlockTable(tiers)
        cache.grow(table, total)
        cache.demote(table, context + TIERS.hot_tokens if prefill else total)  # the chunk stays hot
        cache.take_warm_copies()  # the codes are random already: no quantize needed for timing
        tables.append(table)
    rows = [RowInput(t, total - new_tokens, new_tokens) for t in tables]
    # flash-decoding workspace: decode rows only; the chunk is the one shape the dense path shows cuDNN
    backend = TritonBackend(cache, HEADS, batch, chunk_tokens=new_tokens)
    # a variant's block_m sets the prefill's split, as in the engine
    backend.prefill_launch = backend.prefix_pages_launch = dict(launch)
    if segments is None:
        tokens = batch * new_tokens
        split = backend.prefill_segments(tokens, batch, new_tokens, total) if prefill else None
        segments = split or backend.num_segments(batch, total)
    host = HostMetadata.build(rows, BLOCK, TIERS.group_size // BLOCK)
    metadata = AttentionMetadata.to_device(
        host, torch.device("cuda"), segments, max_prefix_blocks=backend.max_prefix_blocks if pages else 0,
        dense_prefill=dense,
    )  # fmt: skip
    if dense and (metadata.dense is None or backend.dense_ops is None):
        raise SystemExit("the dense prefill path is not available for this step or on this device")
    if pages and metadata.prefix is None:
        raise SystemExit("--prefix-pages needs a prefill (--prefill) over a warm prefix that fits the pages")
    q = torch.randn(batch * new_tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    layer = backend.layers[0]
    partials = None
    if segments > 1:  # an override may split further than the engine's workspace holds
        partials = Partials.empty(batch * new_tokens, HEADS, segments, DIM, torch.device("cuda"))
    out = torch.empty_like(q)

    slots = metadata.slot_mapping
    new_keys = hot.keys[0].flatten(0, 1)[slots]  # the new tokens' keys and values, as a layer has them
    new_values = hot.values[0].flatten(0, 1)[slots]

    def call() -> None:
        if dense:
            out.copy_(backend.forward(q, new_keys, new_values, 0, metadata))
            return
        if pages:  # TritonBackend.forward's prefill over pages, with the launch overrides
            assert metadata.prefix is not None
            prefix = backend._dequantize_prefix(layer, metadata.prefix)
            paged_attention(
                q, layer._replace(warm=None), metadata.paged, out, segments, partials, tile_n=tile_n,
                num_warps=num_warps, prefix_pages=prefix, **launch,
            )  # fmt: skip
            return
        paged_attention(
            q, layer, metadata.paged, out, segments, partials, tile_n=tile_n, num_warps=num_warps, **launch
        )

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    calls = 20
    if dense:  # library kernels of a millisecond or more: timed as launched, with no graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / calls, 0, segments, out.clone()
    # The calls are captured in a CUDA graph and replayed, as the engine's decode runs them: timed
    # from Python, a small launch measures the launch (about 100 us for the kernel and its merge,
    # whatever the work), not the GPU.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    hot_per_token = hot.bytes_per_token // LAYERS  # keys and values in bf16
    held_hot = sum(cache.num_held_hot_blocks(t) for t in tables) * BLOCK  # all of it with the tiers off
    read = held_hot * hot_per_token + (batch * total - held_hot) * (warm.bytes_per_token // LAYERS)
    return start.elapsed_time(end) * 1000 / calls, read, segments, out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="1024,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument(
        "--variants",
        default="",
        help="launch shapes to compare, e.g. 32x4,64x8x2,64x4x3x128,16x1x1x0x4 (see the module docstring)",
    )
    parser.add_argument(
        "--segments", default="", help="splits to compare, e.g. 8,16,32 (default: the engine's)"
    )
    parser.add_argument("--hot-variants", action="store_true", help="time the variants with tiers off too")
    parser.add_argument("--prefill", type=int, default=0, help="new tokens per row; 0: decode")
    parser.add_argument("--prefix-pages", action="store_true", help="prefill: also time the pages path")
    parser.add_argument(
        "--dense",
        action="store_true",
        help="prefill: also time the dense path (tiers on over pages, and off)",
    )
    parser.add_argument(
        "--no-in-place-variants", action="store_true",
        help="time the variants on the pages and tiers-off paths only (the default still runs in place)",
    )  # fmt: skip
    args = parser.parse_args()
    variants = [None] + [v for v in args.variants.split(",") if v]
    splits = [int(x) or None for x in args.segments.split(",") if x] or [None]  # 0: the engine's
    print("| context | batch | tiers | launch | segments | µs per layer call | MB read | GB/s "
          "| TFLOP/s | vs default |")  # fmt: skip
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            hot = variants if args.hot_variants else [None]
            in_place = [None] if args.no_in_place_variants else variants
            runs = [(True, v, False) for v in in_place] + [(False, v, False) for v in hot]
            if args.prefix_pages:
                runs[1:1] = [(True, v, True) for v in variants]
            dense_runs = [(True, True), (False, False)] if args.dense and args.prefill else []
            defaults: dict[tuple[bool, bool], torch.Tensor] = {}  # (tiers, pages) -> the default's output
            # prefill: every new token sees the cached context and the new tokens up to itself
            new = args.prefill
            flops = 4 * DIM * HEADS * batch * (new * context + new * (new + 1) // 2)
            for (tiered, variant, pages), split in itertools.product(runs, splits):
                launch = launch_overrides(variant)
                if variant is None and args.prefill:  # the engine's prefill launch
                    launch = dict(PREFIX_PAGES_LAUNCH if pages else PREFILL_LAUNCH)
                us, read, segments, out = time_decode(
                    batch, context, tiered, segments=split, prefill=args.prefill, pages=pages, **launch
                )
                if variant is None:
                    defaults[tiered, pages] = out
                baseline = defaults.get((tiered, pages))
                gap = None if baseline is None else (out.float() - baseline.float()).abs().max().item()
                differs = "" if gap is None else f"{gap:.1e}"
                shape = (variant or "default") + (" (warm prefix as pages)" if pages else "")
                tiers = "on" if tiered else "off"
                tflops = f"{flops / us / 1e6:.0f}" if new else ""
                print(f"| {context} | {batch} | {tiers} | {shape} | {segments} | {us:.0f} | {read / 1e6:.1f} "
                      f"| {read / us / 1e3:.0f} | {tflops} | {differs} |", flush=True)  # fmt: skip
                torch.cuda.empty_cache()
            for tiered, pages in dense_runs:  # the dense path, against the engine's kernel launch
                us, _, _, out = time_decode(batch, context, tiered, prefill=new, pages=pages, dense=True)
                baseline = defaults.get((tiered, pages))
                differs = (
                    "" if baseline is None else f"{(out.float() - baseline.float()).abs().max().item():.1e}"
                )
                shape = "dense" + (" (warm prefix as pages)" if pages else "")
                print(f"| {context} | {batch} | {'on' if tiered else 'off'} | {shape} | | {us:.0f} | | "
                      f"| {flops / us / 1e6:.0f} | {differs} |", flush=True)  # fmt: skip
                torch.cuda.empty_cache()


def launch_overrides(variant: str | None) -> dict:
    """`64x4x3x128x2x128x1x1` -> paged_attention's launch overrides (tile_n, num_warps, num_stages, maxnreg,
    warm_unroll, block_m, branch_free_rescale, split_causal); a 0 field is left to the default."""
    if variant is None:
        return {}
    names = ("tile_n", "num_warps", "num_stages", "maxnreg", "warm_unroll", "block_m", "branch_free_rescale",
             "split_causal")  # fmt: skip
    fields = zip(names, (int(x) for x in variant.split("x")), strict=False)
    return {name: value for name, value in fields if value or name in ("tile_n", "num_warps")}


if __name__ == "__main__":
    main()
