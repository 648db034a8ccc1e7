"""The fused paged-attention kernel against a dense float64 reference, on fresh random caches.

On the CPU these run through Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest) at small
shapes; on a GPU at the same shapes and more. Tables mix sink, warm, dropped and hot blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from services.engine.attention import paged_kernels
from services.engine.attention.metadata import prefix_plan_arrays
from services.engine.attention.paged_kernels import (
    MIN_GPU_TILE,
    PagedAttentionPlan,
    PagedLayer,
    Partials,
    WarmLayer,
    WarmPrefixPages,
    head_dim_padded,
    paged_attention,
)
from services.engine.attention.triton_backend import dequantize_prefix
from services.engine.kv.kivi import key_params_natural

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    queries_per_kv: int
    head_dim: int
    block_size: int = 16
    group_size: int = 32  # tokens per warm group (a multiple of the block size)

    @property
    def blocks_per_group(self) -> int:
        return self.group_size // self.block_size

    @property
    def value_group(self) -> int:
        return min(self.group_size, self.head_dim)


@dataclass
class RowLayout:
    """One row's tier per logical block: ('hot', id) / ('warm', warm block) / ('dropped', None)."""

    q_len: int
    seq_len: int
    blocks: list[tuple[str, int | None]]


def random_cache(shape: Shape, num_blocks: int, num_groups: int, dtype, with_warm: bool, gen):
    kvh, dim, bs = shape.num_kv_heads, shape.head_dim, shape.block_size
    hot_keys = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    hot_values = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    if not with_warm:
        return PagedLayer(hot_keys, hot_values, None, 1)
    warm_blocks = num_groups * shape.blocks_per_group
    nvg = dim // shape.value_group

    def codes():
        return torch.randint(0, 256, (warm_blocks, bs, kvh, dim // 2), generator=gen, dtype=torch.uint8)

    def scale(*size):
        return (torch.rand(*size, generator=gen) * 0.2 + 0.01).half()

    def zero(*size):
        return (torch.randn(*size, generator=gen) * 0.5).half()

    warm = WarmLayer(
        codes(),
        scale(num_groups, kvh, dim),
        zero(num_groups, kvh, dim),
        codes(),
        scale(warm_blocks, bs, kvh, nvg),
        zero(warm_blocks, bs, kvh, nvg),
    )
    return PagedLayer(hot_keys, hot_values, warm, shape.blocks_per_group)


def random_layouts(
    shape: Shape, rows: list[tuple[int, int]], with_warm: bool, num_blocks: int, num_groups: int, rng
):
    """Assign each row's logical blocks: a hot sink block, then warm or dropped groups, then hot."""
    free_hot = list(range(1, num_blocks))
    free_groups = list(range(num_groups))
    rng.shuffle(free_hot)
    rng.shuffle(free_groups)
    layouts = []
    for q_len, seq_len in rows:
        num_logical = -(-seq_len // shape.block_size)
        blocks: list[tuple[str, int | None]] = []
        index = 0
        if with_warm and num_logical > 1 + shape.blocks_per_group:
            blocks.append(("hot", free_hot.pop()))  # sink
            index = 1
            # cold region: whole groups, but keep the blocks holding new tokens hot
            first_new_block = (seq_len - q_len) // shape.block_size
            while index + shape.blocks_per_group <= min(num_logical - 1, first_new_block):
                if rng.random() < 0.8 and free_groups:
                    group = free_groups.pop()
                    blocks += [
                        ("warm", group * shape.blocks_per_group + i) for i in range(shape.blocks_per_group)
                    ]
                else:
                    blocks += [("dropped", None)] * shape.blocks_per_group
                index += shape.blocks_per_group
        blocks += [("hot", free_hot.pop()) for _ in range(index, num_logical)]
        layouts.append(RowLayout(q_len, seq_len, blocks))
    return layouts


def dequantize(codes, scale, zero, channels_per_scale):
    low, high = codes & 15, codes >> 4
    unpacked = torch.stack((low, high), -1).flatten(-2).double()  # [..., D]
    scale = scale.double().repeat_interleave(channels_per_scale, -1)
    zero = zero.double().repeat_interleave(channels_per_scale, -1)
    return unpacked * scale + zero


def dense_row(layer: PagedLayer, shape: Shape, layout: RowLayout, dtype):
    """The row's keys/values `[L, KVH, D]` float64 (rounded to the model dtype) and which are present."""
    keys, values, present = [], [], []
    bs = shape.block_size
    for tier, index in layout.blocks:
        if tier == "hot":
            keys.append(layer.hot_keys[index].double())
            values.append(layer.hot_values[index].double())
        elif tier == "warm":
            warm = layer.warm
            group = index // shape.blocks_per_group
            k = dequantize(
                warm.key_codes[index],
                key_params_natural(warm.key_scale[group]).unsqueeze(0),
                key_params_natural(warm.key_zero[group]).unsqueeze(0),
                1,
            )
            v = dequantize(
                warm.value_codes[index], warm.value_scale[index], warm.value_zero[index], shape.value_group
            )
            keys.append(k.float().to(dtype).double())
            values.append(v.float().to(dtype).double())
        else:
            keys.append(torch.zeros(bs, shape.num_kv_heads, shape.head_dim, dtype=torch.float64))
            values.append(torch.zeros_like(keys[-1]))
        present += [tier != "dropped"] * bs
    length = layout.seq_len
    return torch.cat(keys)[:length], torch.cat(values)[:length], torch.tensor(present[:length])


def reference(q, layer, shape, layouts, dtype):
    outs = []
    start = 0
    for layout in layouts:
        keys, values, present = dense_row(layer, shape, layout, dtype)
        rows_q = q[start : start + layout.q_len].double()  # [S, H, D]
        keys = keys.repeat_interleave(shape.queries_per_kv, 1)  # [L, H, D]
        values = values.repeat_interleave(shape.queries_per_kv, 1)
        scores = torch.einsum("shd,lhd->hsl", rows_q, keys) / shape.head_dim**0.5
        q_pos = torch.arange(layout.seq_len - layout.q_len, layout.seq_len).view(1, -1, 1)
        visible = (torch.arange(layout.seq_len).view(1, 1, -1) <= q_pos) & present.view(1, 1, -1)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
        outs.append(torch.einsum("hsl,lhd->shd", weights, values))
        start += layout.q_len
    return torch.cat(outs)


def random_case(shape: Shape, rows, dtype, with_warm: bool, seed: int):
    """A random cache with room for `rows` ((new tokens, sequence length) each), each row's layout in
    it, and the generator to draw the queries from next."""
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-s // shape.block_size) for _, s in rows) + 2
    num_groups = total_blocks // shape.blocks_per_group + 1
    layer = random_cache(shape, total_blocks, num_groups, dtype, with_warm, gen)
    layouts = random_layouts(shape, rows, with_warm, total_blocks, num_groups, random.Random(seed))
    return layer, layouts, gen


def layout_tables(layouts: list[RowLayout]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' hot and warm block tables `[B, MB]` int32 (0 and -1 where a block is not in that tier)."""
    width = max(len(lay.blocks) for lay in layouts) + 1
    block_tables = torch.zeros(len(layouts), width, dtype=torch.int32)
    warm_tables = torch.full((len(layouts), width), -1, dtype=torch.int32)
    for i, layout in enumerate(layouts):
        for j, (tier, index) in enumerate(layout.blocks):
            if tier == "hot":
                block_tables[i, j] = index
            elif tier == "warm":
                warm_tables[i, j] = index
    return block_tables, warm_tables


def run_case(
    shape: Shape,
    rows,
    dtype,
    with_warm: bool,
    num_segments: int,
    seed: int,
    prefix_pages: bool = False,
    q_scale: float = 1.0,
    **launch,
):
    """The kernel on random tables against the float64 reference. With `prefix_pages`, the warm blocks
    are first dequantized into pages of the hot layout (a prefill's path in `TritonBackend`) and the
    kernel reads them from there."""
    layer, layouts, gen = random_case(shape, rows, dtype, with_warm, seed)
    num_tokens = sum(q for q, _ in rows)
    num_heads = shape.num_kv_heads * shape.queries_per_kv
    q = (torch.randn(num_tokens, num_heads, shape.head_dim, generator=gen) * q_scale).to(dtype)
    block_tables, warm_tables = layout_tables(layouts)
    starts = [0]
    for q_len, _ in rows:
        starts.append(starts[-1] + q_len)
    plan = PagedAttentionPlan(
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([s for _, s in rows], dtype=torch.int32),
        block_tables,
        warm_tables,
        max(q for q, _ in rows),
    )
    expected = reference(q, layer, shape, layouts, dtype)

    def to_device(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x

    dev_layer = PagedLayer(
        to_device(layer.hot_keys),
        to_device(layer.hot_values),
        None if layer.warm is None else WarmLayer(*map(to_device, layer.warm)),
        layer.blocks_per_group,
    )
    dev_plan = PagedAttentionPlan(*map(to_device, plan))
    out = torch.full_like(q, float("nan"), device=DEVICE)  # poisoned: every element must be written
    partials = None
    if num_segments > 1:
        partials = Partials.empty(
            num_tokens, num_heads, num_segments, head_dim_padded(shape.head_dim), DEVICE
        )
    if prefix_pages:
        arrays = prefix_plan_arrays(warm_tables.numpy(), max_blocks=1 << 20)
        assert arrays is not None, "the case has no warm block to read from pages"
        blocks = torch.from_numpy(arrays[0])
        page_shape = (len(blocks) + 1, *layer.hot_keys.shape[1:])
        keys = torch.full(page_shape, float("nan"), dtype=dtype)  # page 0 is never read
        values = torch.full(page_shape, float("nan"), dtype=dtype)
        dequantize_prefix(layer, blocks, keys, values)
        pages = WarmPrefixPages(keys.to(DEVICE), values.to(DEVICE), torch.from_numpy(arrays[1]).to(DEVICE))
        in_place = dev_layer._replace(warm=None)
        launch["prefix_pages"] = pages
        paged_attention(q.to(DEVICE), in_place, dev_plan, out, num_segments, partials, **launch)
    else:
        paged_attention(q.to(DEVICE), dev_layer, dev_plan, out, num_segments, partials, **launch)
    got = out.double().cpu()
    assert not got.isnan().any()
    error = (got - expected).norm() / expected.norm()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert error < tolerance, f"relative error {error:.2e}"


SHAPES = [Shape(2, 1, 64), Shape(1, 3, 64), Shape(2, 4, 128), Shape(1, 8, 64), Shape(1, 2, 8)]


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"kvh{s.num_kv_heads}-gqa{s.queries_per_kv}-d{s.head_dim}"
)
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_decode_matches_reference(shape, with_warm):
    """Decode rows: a context of 1, block and group edges, and a long row that spans warm groups."""
    rows = [(1, 1), (1, 16), (1, 17), (1, 33), (1, 150)]
    run_case(shape, rows, torch.float32, with_warm, num_segments=1, seed=1)


@pytest.mark.parametrize("num_segments", [2, 4])
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_split_decode_matches_reference(num_segments, with_warm):
    """Flash-decoding: segments that are empty, partly full and full merge to the same answer."""
    rows = [(1, 1), (1, 64), (1, 200)]
    run_case(Shape(2, 4, 64), rows, torch.float32, with_warm, num_segments, seed=2)


@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_a_split_into_more_segments_than_one_merge_chunk_matches_reference(with_warm):
    """A one-row decode splits up to 128 ways (MAX_WARM_SEGMENTS); the merge reads the segments 32 at
    a time. Here 38 one-tile segments hold positions, across both merge chunks."""
    rows = [(1, 600), (1, 40)]
    run_case(Shape(1, 4, 64), rows, torch.float32, with_warm, num_segments=64, seed=12, tile_n=16)


@pytest.mark.parametrize("num_segments", [1, 2])
def test_hot_pass_finds_the_hot_tiles_across_scan_chunks(num_segments):
    """One-block tiles over rows of up to 44 tiles: the hot pass reads the tables 16 tiles at a time,
    so it meets the sink in a segment's first chunk, the recent blocks in its last, and nothing hot
    in the chunks between."""
    rows = [(1, 700), (1, 300), (1, 40)]
    run_case(Shape(1, 4, 64), rows, torch.float32, True, num_segments, seed=7, tile_n=16, num_warps=1)


# shapes that take each branch of the one-warp decode's tensor-core layout: head dims of 8 (padded),
# 64 and 128; value groups covering a lane's channels, a word, or less than a word; blocks of 4 to 32
MMA_SHAPES = [
    Shape(2, 4, 128),
    Shape(1, 4, 128, group_size=16),
    Shape(1, 2, 128, block_size=8, group_size=8),
    Shape(1, 8, 64, block_size=32, group_size=64),
    Shape(1, 2, 64, block_size=4, group_size=4),
    Shape(2, 1, 8),
]


@pytest.mark.parametrize("shape", MMA_SHAPES, ids=str)
@pytest.mark.parametrize("tile_blocks", [1, 2])
def test_one_warp_decode_in_the_tensor_core_layout_matches_reference(shape, tile_blocks):
    """A one-warp warm decode numbers the channels its own way (MMA_LAYOUT): the query, the scales and
    the accumulator must follow, at every head dim, value group and block size, split or not."""
    rows = [(1, 1), (1, 40), (1, 150)]
    tile_n = shape.block_size * tile_blocks
    if DEVICE.type == "cuda":
        tile_n = max(MIN_GPU_TILE, tile_n)  # the tensor cores' shortest reduction
    for num_segments in (1, 2):
        run_case(shape, rows, torch.float32, True, num_segments, seed=9, tile_n=tile_n, num_warps=1)


@pytest.mark.parametrize("warm_unroll", [1, 3])
def test_one_warp_decode_unrolled_any_way_matches_reference(warm_unroll):
    """The one-warp warm loop unrolled by other factors than the engine's (SINGLE_WARP_UNROLL): each
    segment's tile count, odd or even, leaves a remainder that runs unrolled less."""
    rows = [(1, 1), (1, 40), (1, 150), (1, 300)]
    tile_n = MIN_GPU_TILE if DEVICE.type == "cuda" else 16
    for num_segments in (1, 2):
        run_case(
            Shape(2, 4, 64), rows, torch.float32, True, num_segments, seed=12, tile_n=tile_n, num_warps=1,
            warm_unroll=warm_unroll,
        )  # fmt: skip


@pytest.mark.parametrize("branch_free", [False, True], ids=["branch", "branch-free"])
@pytest.mark.parametrize("q_scale", [6.0, 40.0])
def test_one_warp_decode_rescales_lazily_when_scores_climb(q_scale, branch_free):
    """The one-warp decode moves its running max only when a tile's max passes it by more than
    LAZY_RESCALE_LOG2: with a large query the scores span tens of log2 units, so over a long row the
    max climbs by small steps (skipped rescales, probabilities above 1) and by large ones (rescaled).
    Both rescales: the warp's branch (all heads together) and the branch-free one (each head alone)."""
    rows = [(1, 240), (1, 64)]
    tile_n = MIN_GPU_TILE if DEVICE.type == "cuda" else 16
    for num_segments in (1, 4):
        run_case(
            Shape(2, 4, 64), rows, torch.float32, True, num_segments, seed=11, q_scale=q_scale,
            tile_n=tile_n, num_warps=1, branch_free_rescale=branch_free,
        )  # fmt: skip


@pytest.mark.parametrize(("tile_n", "num_warps"), [(32, 4), (64, 8), (16, 2), (16, 1)])
def test_every_launch_shape_the_benchmark_compares_matches_reference(tile_n, num_warps):
    """Tiles of one block or several, with fewer or more warps: the same answer (decode and prefill)."""
    rows = [(1, 1), (1, 33), (1, 150), (20, 120)]
    run_case(
        Shape(2, 4, 64), rows, torch.float32, True, num_segments=1, seed=5, tile_n=tile_n, num_warps=num_warps
    )


@pytest.mark.parametrize("shape", [Shape(2, 1, 64), Shape(1, 3, 64), Shape(1, 4, 128)], ids=str)
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_prefill_matches_reference(shape, with_warm):
    """Packed variable-length rows: whole prompts, a chunk over a cached (tiered) prefix, and decode."""
    rows = [(37, 37), (20, 120), (1, 90), (70, 70)]
    run_case(shape, rows, torch.float32, with_warm, num_segments=1, seed=3)


@pytest.mark.parametrize("num_segments", [2, 8])
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_split_prefill_matches_reference(num_segments, with_warm):
    """A prefill split across programs (short chunks over long contexts): the causal edge falls
    inside a segment, later segments of a query block see none of its early queries' keys, and a
    decode row and a whole prompt ride in the same step."""
    rows = [(16, 300), (5, 150), (1, 90), (40, 40)]
    run_case(Shape(2, 4, 64), rows, torch.float32, with_warm, num_segments, seed=13)


@pytest.mark.parametrize(("block_m", "num_warps"), [(128, 8), (32, 4)])
def test_prefill_with_more_or_fewer_rows_a_program_matches_reference(block_m, num_warps):
    """`block_m` (the benchmark's sixth launch field): more or fewer (token, head) rows a program, on
    the warm tier in place and over pages, split or not."""
    rows = [(37, 37), (20, 120), (1, 90), (16, 300)]
    for prefix_pages, num_segments in ((False, 1), (True, 1), (True, 2)):
        run_case(
            Shape(1, 4, 64), rows, torch.float32, True, num_segments, seed=15, prefix_pages=prefix_pages,
            block_m=block_m, num_warps=num_warps,
        )  # fmt: skip


@pytest.mark.parametrize(("block_m", "num_segments"), [(64, 1), (16, 1), (64, 2)])
def test_prefill_with_the_causal_compare_on_diagonal_tiles_only_matches_reference(block_m, num_segments):
    """`split_causal`: a query block's tiles before its first query run without the causal compare.
    Chunks over long hot prefixes and over pages, a chunk whose first query sits one position short
    of a tile's edge (after 286 cached positions), whole prompts whose diagonal falls inside a tile or
    on its edge (64 new tokens at 16-position tiles), a block past a row's end, and decode."""
    rows = [(37, 37), (20, 122), (1, 90), (64, 64), (16, 302)]
    for with_warm, prefix_pages in ((False, False), (True, True)):
        run_case(
            Shape(1, 4, 64), rows, torch.float32, with_warm, num_segments, seed=16, prefix_pages=prefix_pages,
            tile_n=16, block_m=block_m, split_causal=True,
        )  # fmt: skip


@pytest.mark.parametrize("num_segments", [1, 4])
def test_split_prefill_over_dequantized_warm_pages_matches_reference(num_segments):
    """The pages path splits the same way."""
    rows = [(16, 300), (20, 120)]
    run_case(Shape(1, 4, 64), rows, torch.float32, True, num_segments, seed=14, prefix_pages=True)


@pytest.mark.parametrize("shape", [Shape(2, 1, 64), Shape(1, 4, 128), Shape(1, 2, 8)], ids=str)
def test_prefill_over_dequantized_warm_pages_matches_reference(shape):
    """A prefill whose warm prefix was dequantized once into pages: the same answer as the float64
    reference, with hot, warm and dropped blocks mixed in each row, and decode rows in the step."""
    rows = [(37, 37), (20, 120), (1, 90), (16, 200)]
    run_case(shape, rows, torch.float32, True, num_segments=1, seed=6, prefix_pages=True)


def test_prefix_plan_numbers_each_warm_block_once_and_gives_up_past_its_cap():
    """Pages 1..S for the distinct warm blocks, shared by rows that read the same block; none past the cap."""
    warm = torch.tensor([[-1, 7, 7, 3, -1], [3, 9, -1, -1, -1]], dtype=torch.int32).numpy()
    arrays = prefix_plan_arrays(warm, max_blocks=3)
    assert arrays is not None
    blocks, tables = arrays
    assert blocks.tolist() == [3, 7, 9]
    assert tables.tolist() == [[0, 2, 2, 1, 0], [1, 3, 0, 0, 0]]
    assert prefix_plan_arrays(warm, max_blocks=2) is None
    assert prefix_plan_arrays(warm, max_blocks=0) is None
    assert prefix_plan_arrays(warm * 0 - 1, max_blocks=3) is None  # no warm block: nothing to page


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's CPU interpreter has no bf16 arithmetic")
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_bf16_matches_reference(with_warm):
    """bf16 operands, fp32 accumulation: within bf16 rounding of the float64 answer."""
    rows = [(1, 70), (9, 90)]
    run_case(Shape(2, 4, 64), rows, torch.bfloat16, with_warm, num_segments=2, seed=4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's CPU interpreter has no bf16 arithmetic")
def test_bf16_prefill_over_dequantized_warm_pages_matches_reference():
    """bf16 pages of the warm prefix: within bf16 rounding of the float64 answer."""
    run_case(Shape(2, 4, 64), [(9, 90), (20, 120)], torch.bfloat16, True, 1, seed=7, prefix_pages=True)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's CPU interpreter has no bf16 arithmetic")
@pytest.mark.parametrize("shape", MMA_SHAPES, ids=str)
def test_bf16_one_warp_decode_unpacks_codes_in_ptx_matches_reference(shape):
    """bf16 on a GPU unpacks the warm codes in PTX, pairs of nibbles straight into tensor-core
    registers (MMA_LAYOUT): within bf16 rounding of the float64 answer."""
    rows = [(1, 40), (1, 150), (1, 300)]
    tile_n = max(MIN_GPU_TILE, shape.block_size)
    run_case(shape, rows, torch.bfloat16, True, 2, seed=10, tile_n=tile_n, num_warps=1)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's CPU interpreter has no bf16 arithmetic")
@pytest.mark.parametrize("branch_free", [False, True], ids=["branch", "branch-free"])
@pytest.mark.parametrize("q_scale", [6.0, 40.0])
def test_bf16_one_warp_decode_rescales_lazily_when_scores_climb(q_scale, branch_free):
    """The PTX path's lazy rescale (the probabilities reach the second product through movmatrix): as
    the fp32 test above, with bf16 operands, within bf16 rounding."""
    rows = [(1, 300), (1, 500), (1, 64)]
    for num_segments in (1, 4):
        run_case(
            Shape(2, 4, 128), rows, torch.bfloat16, True, num_segments, seed=11, q_scale=q_scale,
            tile_n=MIN_GPU_TILE, num_warps=1, branch_free_rescale=branch_free,
        )  # fmt: skip


@pytest.mark.skipif(DEVICE.type == "cuda", reason="counts the tiles through the CPU interpreter's calls")
@pytest.mark.parametrize("num_warps", [4, 1], ids=["four-warp", "one-warp"])
def test_warm_pass_visits_only_tiles_with_warm_positions(monkeypatch, num_warps):
    """Work, not values: a decode row whose tiles are hot sink, six warm, two hot, split eight ways
    (two tiles a segment, so the last three segments start past the row's end), runs the warm update
    once per warm tile. The hot tiles and the empty segments' ranges cost no warm work: a masked
    tile gives the right answer at the cost of a whole tile, so only a count can see it."""
    shape = Shape(1, 4, 64)
    tiers = ["hot"] + ["warm"] * 6 + ["hot"] * 2  # one tile per block (tile_n = block size)
    seq_len = len(tiers) * shape.block_size
    gen = torch.Generator().manual_seed(3)
    layer = random_cache(shape, 4, 3, torch.float32, True, gen)
    block_tables = torch.zeros(1, len(tiers) + 1, dtype=torch.int32)
    warm_tables = torch.full((1, len(tiers) + 1), -1, dtype=torch.int32)
    hot_blocks, warm_blocks = iter(range(1, 4)), iter(range(6))
    for i, tier in enumerate(tiers):
        if tier == "hot":
            block_tables[0, i] = next(hot_blocks)
        else:
            warm_tables[0, i] = next(warm_blocks)
    plan = PagedAttentionPlan(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
        block_tables, warm_tables, 1,
    )  # fmt: skip
    update = "_mma_warm_update" if num_warps == 1 else "_warm_update"
    original, visits = getattr(paged_kernels, update), []

    def counted(*args, **kwargs):
        visits.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_kernels, update, counted)
    q = torch.randn(1, shape.num_kv_heads * shape.queries_per_kv, shape.head_dim, generator=gen)
    out = torch.empty_like(q)
    partials = Partials.empty(1, q.shape[1], 8, head_dim_padded(shape.head_dim), DEVICE)
    paged_attention(q, layer, plan, out, 8, partials, tile_n=shape.block_size, num_warps=num_warps)
    assert len(visits) == tiers.count("warm") * shape.num_kv_heads
