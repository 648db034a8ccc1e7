"""The dense prefill path: each row's new tokens over its prefix (warm pages, hot blocks gathered in
pieces) with no mask and over themselves causally, merged by log-sum-exp. On the CPU with the fp32
reference ops, against the float64 attention of test_paged_kernels' random tiered caches; on a GPU
the cuDNN and FlashAttention ops against the reference ops too. The engine's greedy tokens through
the path equal the reference backend's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine.attention import dense_prefill
from services.engine.attention.dense_prefill import (
    Attended,
    CudaOps,
    ReferenceOps,
    dense_prefill_attention,
    merge,
    merge_pair,
    plan_rows,
    to_device_plan,
)
from services.engine.attention.triton_backend import TritonBackend, dequantize_prefix
from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from tests.engine.attention.test_paged_kernels import Shape, layout_tables, random_case, reference
from tests.engine.attention.test_triton_backend import _greedy

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="cuDNN and FlashAttention need CUDA")


def run_dense_case(
    shape: Shape, rows, dtype, with_warm: bool, seed: int, ops, device: str, max_warm_blocks: int = 1 << 20
) -> float:
    """The dense path over random tables (hot, warm and dropped blocks), warm blocks dequantized at most
    `max_warm_blocks` at a time; its relative error against the float64 reference."""
    layer, layouts, gen = random_case(shape, rows, dtype, with_warm, seed)
    num_heads = shape.num_kv_heads * shape.queries_per_kv
    q = torch.randn(sum(q for q, _ in rows), num_heads, shape.head_dim, generator=gen).to(dtype)
    block_tables, warm_tables = (tables.numpy() for tables in layout_tables(layouts))
    starts = np.cumsum([0] + [q_len for q_len, _ in rows]).astype(np.int32)
    seq_lens = np.array([s for _, s in rows], dtype=np.int32)
    # the new tokens' own keys and values, as a layer hands them over (already stored in their hot slots)
    new_keys, new_values = [], []
    for (q_len, seq_len), layout in zip(rows, layouts, strict=True):
        for position in range(seq_len - q_len, seq_len):
            tier, block = layout.blocks[position // shape.block_size]
            assert tier == "hot"
            new_keys.append(layer.hot_keys[block, position % shape.block_size])
            new_values.append(layer.hot_values[block, position % shape.block_size])
    k, v = torch.stack(new_keys), torch.stack(new_values)
    pieces = []  # the warm blocks of each dequantize call, to check the pieces' sizes

    def dequantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pieces.append(len(blocks))
        page_shape = (len(blocks) + 1, *layer.hot_keys.shape[1:])
        keys = torch.full(page_shape, float("nan"), dtype=dtype)  # page 0 is never read
        values = torch.full(page_shape, float("nan"), dtype=dtype)
        dequantize_prefix(layer, blocks.cpu(), keys, values)
        return keys[1:].flatten(0, 1).to(device), values[1:].flatten(0, 1).to(device)

    host_rows = plan_rows(starts, seq_lens, block_tables, warm_tables, shape.block_size, max_warm_blocks)
    assert host_rows is not None
    max_q = max(q for q, _ in rows)
    plan = to_device_plan(host_rows, torch.from_numpy(starts).to(device), max_q, torch.device(device))
    out = torch.full_like(q, float("nan"), device=device)
    hot = (layer.hot_keys.to(device), layer.hot_values.to(device))
    to = q.to(device), k.to(device), v.to(device)
    dense_prefill_attention(ops, *to, hot, dequantize if with_warm else None, plan, out)
    assert all(0 < n <= max_warm_blocks for n in pieces)
    got = out.double().cpu()
    assert not got.isnan().any()
    expected = reference(q, layer, shape, layouts, dtype)
    return float((got - expected).norm() / expected.norm())


# whole prompts, chunks over long prefixes that start mid-block, a one-token row (a decode row in a
# prefill step), and a row whose prefix is shorter than one block
ROWS = [(40, 40), (37, 300), (1, 129), (50, 61), (64, 200)]
SHAPES = [Shape(2, 4, 64), Shape(1, 3, 32), Shape(2, 1, 16)]


@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"kvh{s.num_kv_heads}-gqa{s.queries_per_kv}-d{s.head_dim}"
)
def test_dense_prefill_matches_the_float64_reference(shape: Shape, with_warm: bool) -> None:
    assert run_dense_case(shape, ROWS, torch.float32, with_warm, 3, ReferenceOps(), "cpu") < 1e-5


def test_hot_prefix_in_many_pieces_matches_the_reference(monkeypatch) -> None:
    """A hot prefix longer than one gather piece is read in several, each merged in."""
    monkeypatch.setattr(dense_prefill, "DENSE_GATHER_TOKENS", 48)
    rows = [(20, 300), (33, 150)]
    rows_seen = plan_rows(
        np.array([0, 20, 53]), np.array([300, 150]), np.arange(1, 41).reshape(2, 20).astype(np.int32),
        np.full((2, 20), -1, dtype=np.int32), 16, 0,
    )  # fmt: skip
    assert rows_seen is not None and [len(r.hot_slots) for r in rows_seen] == [6, 3]  # 280 and 117 positions
    assert run_dense_case(Shape(2, 2, 32), rows, torch.float32, False, 5, ReferenceOps(), "cpu") < 1e-5


def test_warm_prefix_longer_than_the_pages_is_read_in_pieces() -> None:
    """Warm prefixes of up to 14 blocks through pages of 3 blocks: dequantized and merged piece by piece."""
    rows = [(30, 300), (17, 250), (1, 129)]
    assert run_dense_case(Shape(2, 4, 64), rows, torch.float32, True, 4, ReferenceOps(), "cpu", 3) < 1e-5


def test_plan_splits_the_prefix_by_tier() -> None:
    warm = np.full((2, 8), -1, dtype=np.int32)
    warm[0, 1:5] = [10, 11, 12, 13]
    warm[1, 1:4] = [30, 21, 40]
    hot = np.zeros((2, 8), dtype=np.int32)
    hot[:, 0] = [50, 51]  # the sinks
    hot[:, 5] = [52, 53]  # row 1's block 4 is neither: dropped
    hot[:, 6] = [54, 55]  # the new tokens' block
    rows = plan_rows(np.array([0, 8, 16]), np.array([100, 100]), hot, warm, 16, 3)
    assert rows is not None
    assert [b.tolist() for b in rows[0].warm_blocks] == [[10, 11, 12], [13]]
    assert [b.tolist() for b in rows[1].warm_blocks] == [[30, 21, 40]]
    # hot: the sink block whole, then logical block 5 up to the prefix's end (92 cached positions)
    assert rows[0].hot_slots[0].tolist() == [*range(50 * 16, 51 * 16), *range(52 * 16, 52 * 16 + 12)]
    assert (rows[0].start, rows[0].end, rows[1].start, rows[1].end) == (0, 8, 8, 16)


def test_plan_gives_up_with_a_warm_prefix_and_no_pages_or_too_many_rows_with_a_prefix() -> None:
    warm = np.full((1, 4), -1, dtype=np.int32)
    warm[0, 1] = 7
    hot = np.array([[3, 0, 4, 5]], dtype=np.int32)
    assert plan_rows(np.array([0, 4]), np.array([60]), hot, warm, 16, 0) is None  # warm, but no pages
    assert plan_rows(np.array([0, 4]), np.array([60]), hot, warm, 16, 1) is not None
    rows = dense_prefill.DENSE_PREFILL_MAX_PREFIX_ROWS + 1
    many = plan_rows(
        np.arange(rows + 1), np.full(rows, 20), np.ones((rows, 2), dtype=np.int32),
        np.full((rows, 2), -1, dtype=np.int32), 16, 0,
    )  # fmt: skip
    assert many is None
    whole_prompts = plan_rows(
        np.arange(0, 20 * (rows + 1), 20), np.full(rows, 20), np.ones((rows, 2), dtype=np.int32),
        np.full((rows, 2), -1, dtype=np.int32), 16, 0,
    )  # fmt: skip
    assert whole_prompts is not None  # rows with no prefix need no loop: any number of them


def test_merge_of_parts_equals_attention_over_their_union() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(5, 4, 8, generator=gen),
        torch.randn(30, 2, 8, generator=gen),
        torch.randn(30, 2, 8, generator=gen),
    )
    ops = ReferenceOps()
    whole = ops.rectangle(q, k, v)
    parts = [ops.rectangle(q, k[a:b], v[a:b]) for a, b in ((0, 7), (7, 8), (8, 30))]
    torch.testing.assert_close(merge(parts), whole.out, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_cuda)], ids=["fp32", "bf16"]
)
def test_merge_kernel_matches_the_oracle_with_strided_parts_and_in_place(dtype) -> None:
    """The one-pass Triton merge (the Triton interpreter on the CPU) against `merge`: a part whose
    log-sum-exp is a transposed view (as FlashAttention's), a part written over in place, a tail of
    rows that fills no whole program."""
    device = "cuda" if CUDA else "cpu"  # compiled Triton takes no CPU tensors
    gen = torch.Generator().manual_seed(3)
    length, heads, dim = 37, 6, 40
    a = Attended(torch.randn(length, heads, dim, generator=gen).to(dtype).to(device),
                 (torch.randn(heads, length, generator=gen) * 4).to(device).transpose(0, 1))  # fmt: skip
    wide = torch.randn(length, 2 * heads, dim, generator=gen).to(dtype).to(device)
    b = Attended(wide[:, ::2], (torch.randn(length, heads, generator=gen) * 4).to(device))  # strided heads
    want = merge([a, b]).float()
    want_lse = torch.logaddexp(a.lse, b.lse)
    got = merge_pair(a, b, a.out.clone(), kernel=True)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.out.float(), want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got.lse, want_lse, atol=1e-5, rtol=1e-5)
    in_place = merge_pair(a, b, a.out, kernel=True)
    assert in_place.out.data_ptr() == a.out.data_ptr()
    torch.testing.assert_close(in_place.out.float(), want, atol=tolerance, rtol=tolerance)


@needs_cuda
@pytest.mark.parametrize("query_len", [300, 0], ids=["cudnn-and-flash", "flash-only"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_ops_match_the_reference_ops(dtype, query_len: int, monkeypatch) -> None:
    """CudaOps for a chunk of 300 queries (cuDNN over the keys' whole granules, FlashAttention over the
    rest) and for a chunk no row has (FlashAttention alone), against the fp32 reference ops."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(300, 32, 128, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1400, 8, 128, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1400, 8, 128, device="cuda", dtype=dtype, generator=gen)
    fused, ref = CudaOps(query_len), ReferenceOps()
    for keys in (slice(None, None, 2), slice(0, 2 * dense_prefill.PLAN_KEY_GRANULE)):  # strided; one granule
        got, want = fused.rectangle(q, k[keys], v[keys]), ref.rectangle(q, k[keys], v[keys])
        torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.lse, want.lse, atol=1e-2, rtol=1e-3)
    many = (torch.tensor([0, 1, 120, 300], dtype=torch.int32, device="cuda"), [(0, 1), (1, 120), (120, 300)])
    one = (torch.tensor([0, 300], dtype=torch.int32, device="cuda"), [(0, 300)])
    for cu, bounds in (many, one):
        want = ref.causal(q, k[:300], v[:300], cu, 300, bounds)
        for max_rows in (8, 0):  # rows of the chunk length one by one through cuDNN; FlashAttention
            monkeypatch.setattr(dense_prefill, "CUDNN_SQUARE_MAX_ROWS", max_rows)
            got = fused.causal(q, k[:300], v[:300], cu, 300, bounds)
            torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got.lse, want.lse, atol=1e-2, rtol=1e-3)


def test_cudnn_sees_only_the_chunk_length_and_whole_key_granules(monkeypatch) -> None:
    """The shapes CudaOps hands cuDNN stay a bounded set whatever the prefix: queries of the chunk
    length and keys in whole granules; FlashAttention takes the rest, and the parts merge to the
    attention over all keys. The library calls are fp32 reference attention here (recording what
    they are given), so the split and merge run on the CPU."""
    granule = dense_prefill.PLAN_KEY_GRANULE
    calls: list[tuple[str, int, int]] = []

    def library(name: str):  # type: ignore[no-untyped-def]
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
            calls.append((name, q.shape[0], k.shape[0]))
            return ReferenceOps().rectangle(q, k, v)

        return attend

    monkeypatch.setattr(dense_prefill, "_cudnn_rectangle", library("cudnn"))
    monkeypatch.setattr(dense_prefill, "_flash_rectangle", library("flash"))
    gen = torch.Generator().manual_seed(4)
    ops = CudaOps(query_len=24)
    for queries, keys in ((24, 2 * granule + 37), (24, granule), (24, granule - 1), (23, 3 * granule)):
        q = torch.randn(queries, 4, 16, generator=gen)
        k, v = torch.randn(keys, 2, 16, generator=gen), torch.randn(keys, 2, 16, generator=gen)
        got, want = ops.rectangle(q, k, v), ReferenceOps().rectangle(q, k, v)
        torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)
    assert calls == [
        ("cudnn", 24, 2 * granule), ("flash", 24, 37),  # whole granules, then the rest
        ("cudnn", 24, granule),  # whole granules only
        ("flash", 24, granule - 1),  # less than one granule
        ("flash", 23, 3 * granule),  # not the chunk length
    ]  # fmt: skip


@needs_cuda
def test_library_kernels_are_checked_at_startup_and_refuse_fp32() -> None:
    assert dense_prefill.cuda_ops_work(torch.device("cuda"), torch.bfloat16, 32, 8, 128)
    assert not dense_prefill.cuda_ops_work(torch.device("cuda"), torch.float32, 32, 8, 128)


@needs_cuda
@pytest.mark.parametrize("with_warm", [False, True], ids=["hot", "tiered"])
def test_dense_prefill_with_cuda_ops_matches_the_float64_reference(with_warm: bool) -> None:
    rows = [(200, 200), (300, 1500), (1, 129), (64, 700)]  # the row of 300 is the chunk cuDNN sees
    ops = CudaOps(query_len=300)
    assert run_dense_case(Shape(8, 4, 128), rows, torch.bfloat16, with_warm, 9, ops, "cuda") < 2e-2


def test_engine_prefill_through_the_dense_path_equals_the_reference(tiny_dir: Path, monkeypatch) -> None:
    """64-token chunks over a warm prefix through the dense path, beside another request's decode rows:
    the reference backend's greedy tokens. The test's model is fp32, for which the startup check turns
    the library kernels off, so the path runs with the reference ops here; the CUDA ops are checked
    above."""
    from services.engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DENSE_PREFILL_MIN_QUERY_TOKENS", 2)
    monkeypatch.setattr(triton_backend, "cuda_ops_work", lambda *args: True)
    monkeypatch.setattr(triton_backend, "CudaOps", ReferenceOps)
    # both requests may run at once (the built-in batch class takes half the batch): the second
    # prompt's chunks run beside the first's decode rows, as mixed steps
    classes = IntentClasses(
        {name: IntentClass(name, priority=0, queue_timeout_s=600.0) for name in ("standard", "batch")}
    )
    reference_tokens, _ = _greedy(tiny_dir, "reference", classes=classes)
    dense_tokens, engine = _greedy(tiny_dir, "triton", classes=classes)
    backend = engine.runner.attention
    assert isinstance(backend, TritonBackend)
    assert backend.num_dense_layer_calls > 0 and backend.num_prefix_layer_calls > 0  # over warm pages
    assert engine.runner.num_mixed_steps > 0
    assert dense_tokens == reference_tokens


@pytest.mark.parametrize(("attention", "is_dense"), [("triton", True), ("triton-paged", False)])
def test_attention_setting_triton_paged_keeps_every_prefill_on_the_kernel(
    tiny_dir: Path, monkeypatch, attention: str, is_dense: bool
) -> None:
    """THERMOCLINE_ENGINE_ATTENTION=triton-paged: the backend offers no step the dense path, even where
    its library kernels pass the start-up check (here the reference ops stand in for them)."""
    from services.engine.attention import triton_backend
    from services.engine.llm_engine import LLMEngine

    monkeypatch.setattr(triton_backend, "cuda_ops_work", lambda *args: True)
    monkeypatch.setattr(triton_backend, "CudaOps", ReferenceOps)
    engine = LLMEngine.load(
        tiny_dir, device="cpu", dtype="float32", max_seq_len=256, attention=attention, progress=False
    )
    backend = engine.runner.attention
    assert isinstance(backend, TritonBackend)
    assert backend.wants_dense_prefill(4096) is is_dense
    assert not backend.wants_dense_prefill(triton_backend.DENSE_PREFILL_MIN_QUERY_TOKENS - 1)
