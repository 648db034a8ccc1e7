"""The paged-attention kernel compiled for sm_90 on the CPU: instructions, spills and shared memory of
its main loop, per launch variant, with no GPU.

Triton's compiler, `ptxas` and `cuobjdump` ship in the Triton wheel and run on any x86-64 machine, so
a change to `services/engine/attention/paged_kernels.py` can be weighed before a device call: the
warm loop's instructions per warp per tile, the register spills inside it (local-memory stores and
loads), and the shared memory the software pipeline takes. Use the Triton version the GPU machine has
(its torch pins it; the H200 runs 3.6), since the compilers differ:

    python3 -m pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python tools/kernel_sass.py
    PYTHONPATH=/tmp/triton36 .venv/bin/python tools/kernel_sass.py --variants decode:64x1,prefill:64x8

A variant is `KIND:TILExWARPS`, KIND one of decode (16-row blocks, one query token, warm tier),
prefill (64-row blocks over a warm tier read in place), pages (prefill over dequantized prefix
pages), hot (decode, no warm tier) or prefill-hot (prefill, no warm tier); a one-warp decode compiles
the tensor-core layout the engine launches there (MMA_LAYOUT, 8-column transposed tiles, with the
engine's pipeline stages and unrolled warm loop: its body then holds SINGLE_WARP_UNROLL tiles, and
the per-tile column divides by that; `--unroll` and `--branch-free-rescale` set paged_attention's
`warm_unroll` and `branch_free_rescale`). The shapes are the Llama-3.1-8B attention's (32 query
heads, 8 KV heads, head dim 128, block 16, warm group 32); `--head-dim 64` gives the Llama-3.2-1B's.
Counts are static: the loop body once, both sides of its branches included; `branch` is the longest
forward branch inside the loop (the hot tile's path in a warm loop, skipped on most tiles). What
they predict was checked against the H200 in bench/results/decode_gpu_2026-12-01c.md and
decode_gpu_2026-12-02.md.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.attention import paged_kernels

POINTERS = {
    "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
    "q_ptr": "*bf16", "hot_keys_ptr": "*bf16", "hot_values_ptr": "*bf16", "prefix_keys_ptr": "*bf16",
    "prefix_values_ptr": "*bf16", "prefix_tables_ptr": "*i32", "key_codes_ptr": "*i32",
    "key_scale_ptr": "*fp16", "key_zero_ptr": "*fp16", "value_codes_ptr": "*i32",
    "value_scale_ptr": "*fp16", "value_zero_ptr": "*fp16", "block_tables_ptr": "*i32",
    "warm_tables_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32",
}  # fmt: skip
# The runtime strides that are multiples of 16 at this shape (Triton specializes on that at a real
# launch, and it decides vectorized loads); the table stride is not. The cache strides are constants.
DIVISIBLE = {"stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_prefix_b"}


def cache_strides(head_dim: int) -> dict[str, int]:
    """The cache strides the kernel takes as compile-time constants, for this tool's shape (block 16,
    8 KV heads, warm group 32; codes in int32 words), as the engine's pools have them."""
    words, value_groups = head_dim // 8, head_dim // 32
    return {
        "stride_hot_b": 16 * 8 * head_dim, "stride_hot_t": 8 * head_dim, "stride_hot_h": head_dim,
        "stride_codes_b": 16 * 8 * words, "stride_codes_t": 8 * words, "stride_codes_h": words,
        "stride_kscale_g": 8 * head_dim, "stride_kscale_h": head_dim,
        "stride_vscale_b": 16 * 8 * value_groups, "stride_vscale_t": 8 * value_groups,
        "stride_vscale_h": value_groups,
    }  # fmt: skip


KINDS = {  # kind -> (BLOCK_M, warm tier in place, prefix pages)
    "decode": (16, True, False),
    "prefill": (64, True, False),
    "pages": (64, False, True),
    "hot": (16, False, False),
    "prefill-hot": (64, False, False),
}
DEFAULT_VARIANTS = (
    "decode:64x4,decode:64x2,decode:32x1,decode:16x1,hot:64x4,prefill:64x4,pages:64x4,prefill-hot:64x4"
)


def compile_variant(
    kind: str,
    tile_n: int,
    num_warps: int,
    maxnreg: int | None = None,
    head_dim: int = 128,
    unroll: int | None = None,
    branch_free_rescale: bool = False,
) -> triton.compiler.CompiledKernel:
    block_m, has_warm, has_pages = KINDS[kind]
    kernel = paged_kernels._paged_attention_kernel
    constants = {
        "NUM_KV_HEADS": 8, "BLOCK_SIZE": 16, "BLOCKS_PER_GROUP": 2, "VALUE_GROUP": 32, "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": head_dim, "QUERIES_PER_KV": 4, "BLOCK_M": block_m, "TILE_N": tile_n,
        "NUM_SEGMENTS": 8 if block_m == 16 else 1, "HAS_WARM": has_warm, "HAS_PREFIX_PAGES": has_pages,
        "IEEE_DOT": False, "DECODE": block_m == 16, "ASM_DEQUANT": True,
        "MMA_LAYOUT": has_warm and block_m == 16 and num_warps == 1,
    }  # fmt: skip
    constants["WARM_UNROLL"] = (unroll or paged_kernels.SINGLE_WARP_UNROLL) if constants["MMA_LAYOUT"] else 1
    constants["BRANCH_FREE_RESCALE"] = branch_free_rescale
    constants.update(cache_strides(head_dim))
    if constants["MMA_LAYOUT"]:
        constants["BLOCK_M"] = 8
    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constants else POINTERS.get(n, "fp32" if n == "sm_scale_log2" else "i32")
        for n in names
    }
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in POINTERS or n in DIVISIBLE}
    source = ASTSource(
        kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs
    )
    options = {"num_warps": num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    if constants["MMA_LAYOUT"]:  # as the engine launches it (paged_kernels._warm_decode_launch)
        options["num_stages"] = paged_kernels.SINGLE_WARP_STAGES
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(compiled: triton.compiler.CompiledKernel, flag: str) -> str:
    """cuobjdump's output for the kernel's cubin (`-sass`, `-res-usage`)."""
    cuobjdump = Path(triton.backends.nvidia.__path__[0]) / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [str(cuobjdump), flag, cubin.name], capture_output=True, text=True, check=True
        ).stdout


def registers(compiled: triton.compiler.CompiledKernel) -> int:
    """Registers per thread that ptxas gave the kernel (its resource usage in the cubin)."""
    match = re.search(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage"))
    return int(match.group(1)) if match else 0


def disassemble(compiled: triton.compiler.CompiledKernel) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS."""
    text = _cuobjdump(compiled, "-sass")
    rows = []
    for line in text.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", line)
        if match:
            rows.append((int(match.group(1), 16), match.group(2)))
    return rows


def loop_stats(rows: list[tuple[int, str]]) -> dict[str, int]:
    """The main loop (the largest loop with no loop inside it: the warm loop when there is a warm
    tier, which runs after the hot pass): its size, its longest forward branch, and its spills and
    barriers."""
    loops = []
    for address, instruction in rows:
        target = re.search(r"BRA\s+(0x[0-9a-f]+)", instruction)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    innermost = [
        (start, end)
        for start, end in loops
        if not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)
    ]
    loop = max(innermost, key=lambda span: span[1] - span[0], default=(0, -1))
    body = [(a, i) for a, i in rows if loop[0] <= a <= loop[1]]
    ops = collections.Counter(
        (i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for _, i in body
    )
    branch = 0
    for address, instruction in body:
        target = re.search(r"@!?P\d BRA\s+(0x[0-9a-f]+)", instruction)
        if target and int(target.group(1), 16) > address:
            branch = max(branch, (int(target.group(1), 16) - address) // 16)
    shared = ops["LDS"] + ops["STS"] + ops["LDSM"]  # the L1/shared pipe that ncu found busiest
    return {"loop": len(body), "branch": branch, "STL": ops["STL"], "LDL": ops["LDL"], "BAR": ops["BAR"],
            "shared": shared}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="KIND:TILExWARPS, comma-separated")
    parser.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (ptxas)")
    parser.add_argument("--head-dim", type=int, default=128, help="64: the Llama-3.2-1B attention shape")
    parser.add_argument("--unroll", type=int, default=None, help="one-warp decode: warm-loop unrolling")
    parser.add_argument(
        "--branch-free-rescale", action="store_true", help="one-warp decode: per-head rescale, no branch"
    )
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90, 8 KV heads x 4 queries, head dim {args.head_dim}")
    columns = ("variant", "loop instructions per warp", "branch", "per tile, branch skipped",
               "per position, all warps", "spills (STL/LDL)", "barriers", "shared loads/stores", "shared KB",
               "registers")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for variant in args.variants.split(","):
        kind, launch = variant.split(":")
        tile_n, num_warps = (int(x) for x in launch.split("x"))
        compiled = compile_variant(
            kind, tile_n, num_warps, args.maxnreg, args.head_dim, args.unroll, args.branch_free_rescale
        )
        stats = loop_stats(disassemble(compiled))
        one_warp = kind == "decode" and num_warps == 1
        unroll = (args.unroll or paged_kernels.SINGLE_WARP_UNROLL) if one_warp else 1
        per_tile = (stats["loop"] - stats["branch"]) // unroll
        shared_kb = compiled.metadata.shared / 1024
        cells = (variant, stats["loop"], stats["branch"], per_tile, f"{per_tile * num_warps / tile_n:.1f}",
                 f"{stats['STL']}/{stats['LDL']}", stats["BAR"], stats["shared"], f"{shared_kb:.0f}",
                 registers(compiled))  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
