"""The decode step outside attention, three ways: eager torch ops, our fused Triton ops, torch.compile.

Issue 10 asks for Triton kernels or `torch.compile` on the non-attention parts, whichever measures
faster. This times one Llama-3.1-8B-shaped layer's non-attention work (add+RMSNorm, the merged QKV
projection, RoPE with the K/V cache write, the output projection, add+RMSNorm, the merged gate/up
projection, SiLU·mul, the down projection) 32 times inside one CUDA graph, as the engine's decode
graphs run it, at several decode batch sizes. Attention is left out: it is the same kernel whichever
way the rest is built. The three variants share the weights and start from the same inputs; the
table reports their outputs' largest difference from eager as a check. Needs CUDA.

    python bench/compile_vs_fused.py --batches 1,16,64,256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.model import fused_ops

HIDDEN, HEADS, KV_HEADS, DIM, INTERMEDIATE, LAYERS, EPS = 4096, 32, 8, 128, 14336, 32, 1e-5
BLOCK = 16

EAGER = SimpleNamespace(
    add_rmsnorm=fused_ops.add_rmsnorm_reference,
    rotary_and_store=fused_ops.rotary_and_store_reference,
    silu_mul=fused_ops.silu_mul_reference,
)
FUSED = SimpleNamespace(
    add_rmsnorm=fused_ops.add_rmsnorm,
    rotary_and_store=fused_ops.rotary_and_store,
    silu_mul=fused_ops.silu_mul,
)


def make_inputs(batch: int) -> dict:
    """Weights of one layer (reused by all 32: 436 MB each, far past the L2) and a decode batch."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    positions = torch.arange(batch, device="cuda", dtype=torch.int32) * 7 + 100
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, DIM, 2, device="cuda").float() / DIM))
    angles = torch.outer(torch.arange(4096, device="cuda").float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    blocks = batch + 1
    return {
        "x": weight(batch, HIDDEN) * 50,
        "residual": weight(batch, HIDDEN) * 50,
        "w_qkv": weight((HEADS + 2 * KV_HEADS) * DIM, HIDDEN),
        "w_o": weight(HIDDEN, HEADS * DIM),
        "w_gate_up": weight(2 * INTERMEDIATE, HIDDEN),
        "w_down": weight(HIDDEN, INTERMEDIATE),
        "norm1": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        "norm2": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        "cos": angles.cos(),
        "sin": angles.sin(),
        "positions": positions,
        "keys": torch.zeros(blocks, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        "values": torch.zeros(blocks, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        "slots": (torch.arange(batch, device="cuda") + BLOCK).to(torch.int64),  # block 0 is scratch
    }


def layer(ops, x, residual, t: dict):
    """One layer's work outside attention (the attention output is stood in for by q)."""
    batch = x.shape[0]
    normed, residual = ops.add_rmsnorm(x, residual, t["norm1"], EPS)
    qkv = F.linear(normed, t["w_qkv"])
    q, _, _ = ops.rotary_and_store(
        qkv, HEADS, KV_HEADS, t["cos"], t["sin"], t["positions"], t["keys"], t["values"], t["slots"]
    )
    out = F.linear(q.reshape(batch, -1), t["w_o"])
    normed, residual = ops.add_rmsnorm(out, residual, t["norm2"], EPS)
    return F.linear(ops.silu_mul(F.linear(normed, t["w_gate_up"])), t["w_down"]), residual


def eager_layer(x, residual, t):
    return layer(EAGER, x, residual, t)


def fused_layer(x, residual, t):
    return layer(FUSED, x, residual, t)


def time_variant(fn, t: dict) -> tuple[float, torch.Tensor]:
    """ms per 32-layer replay of `fn` captured in a CUDA graph, and its output."""

    def step():
        x, residual = t["x"], t["residual"]
        for _ in range(LAYERS):
            x, residual = fn(x, residual, t)
        return x

    for _ in range(3):  # warm up (and compile) outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 20
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--mode", default="default", help="torch.compile mode")
    args = parser.parse_args()
    weight_bytes = 2 * HIDDEN * ((HEADS + 2 * KV_HEADS) * DIM + HEADS * DIM + 3 * INTERMEDIATE) * LAYERS
    compiled = torch.compile(eager_layer, mode=args.mode, dynamic=False)
    print(f"torch {torch.__version__}; {torch.cuda.get_device_name()}; compile mode {args.mode}")
    print(f"weights read per step: {weight_bytes / 1e9:.2f} GB (32 layers, attention excluded)\n")
    print("| batch | variant | ms per 32 layers | GB/s of weights | max abs diff vs eager | compile s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        t = make_inputs(batch)
        reference = None
        for name, fn in (
            ("eager torch", eager_layer),
            ("fused Triton (ours)", fused_layer),
            ("torch.compile", compiled),
        ):
            began = time.perf_counter()
            ms, out = time_variant(fn, t)
            setup = time.perf_counter() - began
            reference = out if reference is None else reference
            diff = (out.float() - reference.float()).abs().max().item()
            compile_s = f"{setup:.0f}" if fn is compiled else ""
            print(
                f"| {batch} | {name} | {ms:.2f} | {weight_bytes / ms / 1e6:.0f} | {diff:.3g} | {compile_s} |",
                flush=True,
            )
        del t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
