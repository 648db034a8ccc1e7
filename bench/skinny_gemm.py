"""The decode step's weight products alone: cuBLAS on the Llama projections at decode batch sizes, with
the weight stored row-major (as the engine loads it) and column-major (the same matrix transposed in
memory, so cuBLAS picks its kernels for the other operand layout), beside a candidate Triton kernel
for a few rows (`skinny_linear`: each program one slice of the outputs for every row, over the whole
reduction, its weight tiles streamed through a software pipeline; no split and no second kernel) at
the launch shapes given. bench/results/skinny_gemm_2026-12-05.md says why the engine keeps cuBLAS.

Random bf16 weights in the Llama-3.1-8B (and `--shape 1B` Llama-3.2-1B) projection shapes; each cell
is one product per call, 20 calls captured in one CUDA graph and replayed, reported as µs per call
and the weight bytes read over that time. The calls cycle over copies of the weight that together
pass 400 MB, so that none is still in the 50 MB L2 cache when it is read again (in a decode step, the
other layers' weights come between). Needs CUDA.

    python bench/skinny_gemm.py --batches 1,16,64,256
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {  # name -> [(projection, out_features, in_features)], the merged projections the engine runs
    "8B": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
           ("lm_head", 128256, 4096)],
    "1B": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)],
}  # fmt: skip
CALLS = 20


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, rows, out_features, in_features,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # one program: a BLOCK_N slice of the outputs for every row, over the whole reduction; the rows
    # pad to the tensor cores' 16
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * in_features + k[None, :], mask=m[:, None] < rows, other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * in_features + k[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + m[:, None] * out_features + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m[:, None] < rows)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, launch: tuple) -> None:
    """`out = x @ weight.t()` for at most 16 rows; `launch` is (BLOCK_N, BLOCK_K, stages, warps), which
    must tile the weight `[N, K]` whole."""
    block_n, block_k, stages, warps = launch
    rows, in_features = x.shape
    out_features = weight.shape[0]
    _skinny_linear_kernel[(out_features // block_n,)](
        x, weight, out, rows, out_features, in_features, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], launch: tuple | None = None) -> float:
    """µs per `x @ weight.t()` (cuBLAS, or skinny_linear at `launch`), the best of 5 replays of a graph
    of CALLS calls over `weights`."""
    out = torch.empty(x.shape[0], weights[0].shape[0], device=x.device, dtype=x.dtype)

    def product(weight: torch.Tensor) -> None:
        if launch is None:
            torch.matmul(x, weight.t(), out=out)
        else:
            skinny_linear(x, weight, out, launch)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (cuBLAS's workspace and heuristics, Triton's compile)
        for weight in weights[:3]:
            product(weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS):
            product(weights[call % len(weights)])
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    expected = F.linear(x, weights[(CALLS - 1) % len(weights)])
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8B", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument(
        "--triton",
        default="",
        help="skinny_linear launches NxKxSTAGESxWARPS to time, batch <= 16",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape} projections, bf16")
    launches = [tuple(int(v) for v in t.split("x")) for t in args.triton.split(",") if t]
    columns = ("projection", "batch", "MB", "row-major µs", "GB/s", "column-major µs", "GB/s",
               "best Triton µs", "GB/s", "launch")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, out_features, in_features in SHAPES[args.shape]:
        megabytes = out_features * in_features * 2 / 1e6
        copies = max(2, min(CALLS, math.ceil(400 / megabytes)))
        scale = in_features**-0.5
        weights = [torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * scale
                   for _ in range(copies)]  # fmt: skip
        column_major = [w.t().contiguous().t() for w in weights]  # same values and shape, transposed
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, in_features, device=device, dtype=torch.bfloat16)
            row_us = time_linear(x, weights)
            col_us = time_linear(x, column_major)
            triton_cells = " | | "
            if batch <= 16 and launches:
                timed = [(time_linear(x, weights, launch), launch) for launch in launches
                         if out_features % launch[0] == 0 and in_features % launch[1] == 0]  # fmt: skip
                best_us, best = min(timed)
                triton_cells = f"{best_us:.1f} | {megabytes / best_us * 1e3:.0f} | {'x'.join(map(str, best))}"
            print(f"| {name} | {batch} | {megabytes:.1f} | {row_us:.1f} | {megabytes / row_us * 1e3:.0f} | "
                  f"{col_us:.1f} | {megabytes / col_us * 1e3:.0f} | {triton_cells} |",
                  flush=True)  # fmt: skip
        del weights, column_major
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
