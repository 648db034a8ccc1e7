"""The per-step attention metadata: fixed-dtype int tensors built once per step from the rows' block tables.

Built on the host with NumPy (no device sync), then copied to the device in one pinned, non-blocking
transfer per tensor. A captured CUDA graph reads the same tensors from static buffers sized for its
largest batch (`StaticMetadata`), refilled before each replay.
Shapes: B rows, T packed new tokens (no padding), MB logical blocks per row.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from services.engine.attention.dense_prefill import DensePrefillPlan, plan_rows, to_device_plan
from services.engine.attention.paged_kernels import PagedAttentionPlan
from services.engine.kv.block_pool import SCRATCH_BLOCK
from services.engine.kv.block_table import BlockTable

if TYPE_CHECKING:
    from services.engine.attention.probe import AttentionProbe


class RowInput(NamedTuple):
    """One batch row: its block table and the new tokens' positions `[start, start + num_new)`."""

    table: BlockTable
    start: int
    num_new: int


@dataclass(frozen=True)
class HostMetadata:
    """One step's metadata as host arrays; `to_device` or `StaticMetadata.fill` moves it."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: hot slot (block * BS + offset) each new K/V goes to
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32: visible positions per row, new tokens included
    block_tables: np.ndarray  # [B, MB] int32: hot block per logical block, SCRATCH_BLOCK when not hot
    warm_block_tables: np.ndarray  # [B, MB] int32: warm block per logical block, -1 when not warm
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_rows(self) -> int:
        """Rows B in the step."""
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """Packed new tokens T."""
        return len(self.positions)

    @property
    def is_decode(self) -> bool:
        """Every row computes exactly one new token."""
        return self.max_query_len == 1

    @classmethod
    def build(cls, rows: Seq[RowInput], block_size: int, blocks_per_group: int) -> HostMetadata:
        """Metadata for `rows`; each table must already hold hot blocks for its new positions."""
        num_new = np.array([r.num_new for r in rows], dtype=np.int64)
        starts = np.array([r.start for r in rows], dtype=np.int64)
        seq_lens = starts + num_new
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        width = int(-(-seq_lens.max() // block_size))
        tables = [row.table for row in rows]
        block_tables = _hot_tables(tables, width)
        warm_tables = _warm_tables(tables, width, blocks_per_group)
        row_of_token = np.repeat(np.arange(len(rows)), num_new)  # [T]
        positions = np.arange(len(row_of_token)) - query_start_loc[row_of_token] + starts[row_of_token]
        block_of_token = block_tables[row_of_token, positions // block_size].astype(np.int64)
        slot_mapping = block_of_token * block_size + positions % block_size
        return cls(
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            warm_block_tables=warm_tables,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )

    def last_token_index(self) -> np.ndarray:
        """`[B]` index of each row's last new token in the packed layout."""
        return self.query_start_loc[1:].astype(np.int64) - 1

    def num_leading_decode_rows(self) -> int:
        """How many rows from the first compute one new token each before a row that computes more
        (a mixed step's decode rows, which the scheduler puts first); 0 when no row computes more."""
        if self.is_decode:
            return 0
        longer = np.flatnonzero(np.diff(self.query_start_loc) > 1)
        return int(longer[0])

    def row_range(self, first: int, end: int) -> HostMetadata:
        """The metadata of rows `[first, end)` alone, their tokens packed from 0."""
        token_first, token_end = int(self.query_start_loc[first]), int(self.query_start_loc[end])
        seq_lens = self.seq_lens[first:end]
        return HostMetadata(
            positions=self.positions[token_first:token_end],
            slot_mapping=self.slot_mapping[token_first:token_end],
            query_start_loc=self.query_start_loc[first : end + 1] - token_first,
            seq_lens=seq_lens,
            block_tables=self.block_tables[first:end],
            warm_block_tables=self.warm_block_tables[first:end],
            max_query_len=int(np.diff(self.query_start_loc[first : end + 1]).max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )


# The two tables are filled for all rows at once: one conversion of every row's block list, and one
# scatter per table. Row by row, the NumPy calls cost a few microseconds a row, every step, which at
# batch 256 is time the device waits for.


def _hot_tables(tables: list[BlockTable], width: int) -> np.ndarray:
    """`[B, width]` int32: each row's hot block per logical block, SCRATCH_BLOCK past its list."""
    block_tables = np.full((len(tables), width), SCRATCH_BLOCK, dtype=np.int32)
    lengths = np.fromiter((len(t.hot_block_ids) for t in tables), dtype=np.int64, count=len(tables))
    total = int(lengths.sum())
    if total == 0:
        return block_tables
    ids = np.fromiter(chain.from_iterable(t.hot_block_ids for t in tables), dtype=np.int32, count=total)
    row = np.repeat(np.arange(len(tables)), lengths)
    column = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return _scatter_within(block_tables, row, column, ids)


def _warm_tables(tables: list[BlockTable], width: int, blocks_per_group: int) -> np.ndarray:
    """`[B, width]` int32: each row's warm block per logical block, -1 where it is not warm (a warm
    group spans `blocks_per_group` logical blocks)."""
    warm_tables = np.full((len(tables), width), -1, dtype=np.int32)
    rows, logical, warm = [], [], []
    for i, table in enumerate(tables):
        if table.warm_groups:
            row_logical, row_warm = table.warm_groups.block_arrays(blocks_per_group)  # kept until changed
            rows.append(i)
            logical.append(row_logical)
            warm.append(row_warm)
    if not rows:
        return warm_tables
    row = np.repeat(np.asarray(rows), np.fromiter(map(len, logical), dtype=np.int64, count=len(rows)))
    return _scatter_within(warm_tables, row, np.concatenate(logical), np.concatenate(warm))


def _scatter_within(out: np.ndarray, row: np.ndarray, column: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`out[row, column] = ids`, leaving out the entries past `out`'s width (a row may hold blocks
    past the step's width: they are not read)."""
    if int(column.max()) >= out.shape[1]:
        keep = column < out.shape[1]
        row, column, ids = row[keep], column[keep], ids[keep]
    out[row, column] = ids
    return out


@dataclass(frozen=True)
class QueryTap:
    """Where one layer leaves a decode step's queries, for scoring cold blocks by their summary keys."""

    layer: int
    queries: torch.Tensor  # [B, H, D] fp32, written on the device

    @classmethod
    def build(
        cls, layer: int, num_rows: int, num_heads: int, head_dim: int, device: torch.device
    ) -> QueryTap:
        """An empty tap for a decode step of `num_rows` rows."""
        return cls(layer, torch.zeros(num_rows, num_heads, head_dim, device=device))

    def record(self, q: torch.Tensor) -> None:
        """Keep a decode step's rotated queries `[B, H, D]` (one token per row)."""
        self.queries.copy_(q)


class PrefixPlan(NamedTuple):
    """A prefill step's warm blocks, read as pages of the hot layout (see `TritonBackend`).

    Each layer dequantizes `blocks` once into pages 1..S, so that the step's query blocks read its
    warm prefix as BF16 pages instead of each dequantizing the whole prefix in registers."""

    blocks: torch.Tensor  # [S] int64: warm block ids, page i + 1 holds blocks[i]
    tables: torch.Tensor  # [B, MB] int32: the page of each logical block, 0 where it is not warm


def prefix_plan_arrays(warm_tables: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`(blocks, tables)` for `PrefixPlan` from a step's warm tables, or None when no warm block is
    read or more than `max_blocks` are (then the kernel reads the warm tier in place)."""
    if max_blocks <= 0:
        return None
    is_warm = warm_tables >= 0
    if not is_warm.any():
        return None
    blocks, index = np.unique(warm_tables[is_warm], return_inverse=True)
    if len(blocks) > max_blocks:
        return None
    tables = np.zeros_like(warm_tables)
    tables[is_warm] = index.astype(np.int32) + 1
    return blocks.astype(np.int64), tables


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's metadata on the device; every layer's attention reads it."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    paged: PagedAttentionPlan  # query_start_loc, seq_lens, block tables (int32) for the kernel
    max_seq_len: int  # host int: the reference path's dense width
    num_segments: int = 1  # flash-decoding split of each row's context
    probe: AttentionProbe | None = None  # set on sampled decode steps
    query_tap: QueryTap | None = None  # set on decode steps that score cold blocks
    prefix: PrefixPlan | None = None  # set on prefill steps over a warm prefix (see PrefixPlan)
    dense: DensePrefillPlan | None = None  # set on prefill steps that take dense_prefill's path
    # set on a mixed step: its decode rows and its prompt chunks, each attended as a step of its own
    parts: tuple[MetadataPart, ...] | None = None

    @property
    def max_query_len(self) -> int:
        """Most new tokens in one row."""
        return self.paged.max_query_len

    @classmethod
    def for_rows(
        cls, rows: Seq[RowInput], block_size: int, blocks_per_group: int, device: torch.device
    ) -> AttentionMetadata:
        """Build and copy in one call (tests, tools and benches that drive the model directly)."""
        return cls.to_device(HostMetadata.build(rows, block_size, blocks_per_group), device)

    @classmethod
    def to_device(
        cls,
        host: HostMetadata,
        device: torch.device,
        num_segments: int = 1,
        probe: AttentionProbe | None = None,
        query_tap: QueryTap | None = None,
        max_prefix_blocks: int = 0,
        dense_prefill: bool = False,
    ) -> AttentionMetadata:
        """Copy `host` to `device` (pinned, non-blocking on CUDA). A prefill step over up to
        `max_prefix_blocks` warm blocks gets its `PrefixPlan`; with `dense_prefill`, a prefill step gets
        its `DensePrefillPlan` instead where its rows allow one (`dense_prefill.plan_rows`, which cuts
        each warm prefix into pieces of `max_prefix_blocks`)."""
        paged = PagedAttentionPlan(
            query_start_loc=_to(host.query_start_loc, device),
            seq_lens=_to(host.seq_lens, device),
            block_tables=_to(host.block_tables, device),
            warm_block_tables=_to(host.warm_block_tables, device),
            max_query_len=host.max_query_len,
        )
        dense = None
        if dense_prefill and not host.is_decode:
            rows = plan_rows(
                host.query_start_loc, host.seq_lens, host.block_tables, host.warm_block_tables,
                host.block_size, max_prefix_blocks,
            )  # fmt: skip
            if rows is not None:
                dense = to_device_plan(rows, paged.query_start_loc, host.max_query_len, device)
        arrays = None  # the dense path dequantizes its own pieces of the warm prefix
        if dense is None and not host.is_decode:
            arrays = prefix_plan_arrays(host.warm_block_tables, max_prefix_blocks)
        prefix = None if arrays is None else PrefixPlan(_to(arrays[0], device), _to(arrays[1], device))
        return cls(
            _to(host.positions, device),
            _to(host.slot_mapping, device),
            paged,
            host.max_seq_len,
            num_segments,
            probe,
            query_tap,
            prefix,
            dense,
        )


class MetadataPart(NamedTuple):
    """Rows of a step whose packed tokens `[token_start, token_end)` attend through `metadata` alone."""

    token_start: int
    token_end: int
    metadata: AttentionMetadata


class StaticMetadata:
    """Device buffers a captured decode graph reads, sized for `max_rows` rows of up to `max_blocks` blocks.

    `view(num_rows)` is what capture sees; `fill` writes a smaller batch in place and pads the rest
    with empty rows (no context, K/V written to the scratch slot), so a replay computes nothing for them.
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.warm_block_tables = torch.full((max_rows, max_blocks), -1, dtype=torch.int32, device=device)
        self._staging = torch.zeros(3 * max_rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        # recorded after the staging buffer's copy: an overlapped step fills it again before the
        # last one has synced, so it waits for that copy (long done in practice) before writing
        self._staged: torch.cuda.Event | None = None

    def view(self, num_rows: int, num_segments: int) -> AttentionMetadata:
        """Metadata over the first `num_rows` rows of the buffers (one decode token per row)."""
        paged = PagedAttentionPlan(
            self.query_start_loc[: num_rows + 1],
            self.seq_lens[:num_rows],
            self.block_tables[:num_rows],
            self.warm_block_tables[:num_rows],
            max_query_len=1,
        )
        return AttentionMetadata(
            self.positions[:num_rows],
            self.slot_mapping[:num_rows],
            paged,
            self.max_blocks * self.block_size,
            num_segments,
        )

    def fill(self, host: HostMetadata, num_rows: int) -> None:
        """Write a decode step of `host.num_rows <= num_rows` rows; rows past it become padding."""
        rows = host.num_rows
        staging = self._staging
        if self._staged is not None:
            self._staged.synchronize()
        staging[: 3 * num_rows].zero_()  # padding rows: position 0, scratch slot 0, no context
        staging[:rows] = torch.from_numpy(host.positions)
        staging[num_rows : num_rows + rows] = torch.from_numpy(host.slot_mapping)
        staging[2 * num_rows : 2 * num_rows + rows] = torch.from_numpy(host.seq_lens.astype(np.int64))
        device_copy = staging[: 3 * num_rows].to(self.positions.device, non_blocking=True)
        if device_copy.is_cuda:
            self._staged = torch.cuda.Event()
            self._staged.record()
        self.positions[:num_rows].copy_(device_copy[:num_rows])
        self.slot_mapping[:num_rows].copy_(device_copy[num_rows : 2 * num_rows])
        self.seq_lens[:num_rows].copy_(device_copy[2 * num_rows :])
        width = host.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(_to(host.block_tables, self.block_tables.device))
        self.warm_block_tables[:rows, :width].copy_(_to(host.warm_block_tables, self.block_tables.device))


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
