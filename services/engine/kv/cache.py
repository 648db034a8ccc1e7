"""KV cache storage in device memory: a paged hot tier and an INT4 warm tier, plus the cache over both.

Shapes: N blocks, BS tokens per block, W warm groups, G tokens per warm group, KVH kv heads,
D head dim, B batch rows, S new tokens per row, L visible positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from services.engine.attention.paged_kernels import WarmLayer
from services.engine.kv import demote_kernel, kivi
from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockId, BlockPool
from services.engine.kv.block_table import BlockTable, WarmGroupId
from services.engine.kv.cold_moves import ColdLoad, ColdMoves
from services.engine.model.config import ModelConfig

# Bytes of model-dtype keys read per batched demotion chunk of the reference quantizer (its fp32
# temporaries are a few times this; CUDA runs the fused kernel, which has none).
WARM_COPY_CHUNK_BYTES = 64 << 20
# Bytes of loaded cold blocks copied to the device at a time, each copy still large: the device
# landing buffer a loaded prefix goes through (PrefixWriter; kept once the first hit makes it, and
# outside the memory profile), and the transient copy of an auxiliary window's blocks.
LOAD_CHUNK_BYTES = 256 << 20


class KVTier(ABC):
    """One tier's storage and its accounting. Only `write`/`allocate`/`free` calls change state."""

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Device bytes one token position costs in this tier, all layers."""

    @abstractmethod
    def num_used_tokens(self) -> int:
        """Token positions currently held (reads only)."""

    @abstractmethod
    def capacity_tokens(self) -> int:
        """Token positions this tier can hold at most (reads only)."""

    def used_bytes(self) -> int:
        """Device bytes in use (reads only)."""
        return self.num_used_tokens() * self.bytes_per_token


class HotTier(KVTier):
    """Paged keys and values in the model dtype; `pool` hands out its blocks (block 0 is scratch).

    Layout `[layers, N, BS, KVH, D]`: flattening `N*BS` gives one slot per token position, so
    writes are a single scatter by slot and a paged kernel reads a block as one contiguous tile.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [layers, N, BS, KVH, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # [layers, N, BS, KVH, D]
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self._bytes_per_token = 2 * config.num_layers * config.kv_size * self.keys.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Keys and values, all layers, model dtype."""
        return self._bytes_per_token

    def num_used_tokens(self) -> int:
        """Referenced blocks times the block size."""
        return self.pool.num_used_blocks() * self.block_size

    def capacity_tokens(self) -> int:
        """All blocks but the scratch one."""
        return self.pool.num_blocks * self.block_size

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new `[T, KVH, D]` keys/values to their slots `[T]` (changes state)."""
        num_kv_heads, head_dim = keys.shape[-2:]
        self.keys[layer].view(-1, num_kv_heads, head_dim)[slot_mapping] = keys
        self.values[layer].view(-1, num_kv_heads, head_dim)[slot_mapping] = values

    def warm_copy_chunk(self, group_size: int) -> int:
        """Warm groups one batched demotion quantizes at once: about WARM_COPY_CHUNK_BYTES of keys."""
        group_bytes = self.keys[:, 0].numel() * self.keys.element_size() * (group_size // self.block_size)
        return max(1, WARM_COPY_CHUNK_BYTES // group_bytes)

    def read_blocks(self, block_ids: list[BlockId]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of consecutive blocks, 2 x `[layers, len*BS, KVH, D]`."""
        index = torch.tensor(block_ids, device=self.keys.device)
        keys, values = self.keys[:, index], self.values[:, index]  # [layers, n, BS, KVH, D]
        return keys.flatten(1, 2), values.flatten(1, 2)


class WarmTier(KVTier):
    """INT4 KIVI groups of G tokens: codes packed two per byte, FP16 scales and zero points."""

    def __init__(self, config: ModelConfig, num_groups: int, group_size: int, device: torch.device) -> None:
        layers, heads, dim = config.num_layers, config.num_kv_heads, config.head_dim
        value_groups = dim // min(group_size, dim)
        self.key_codes = torch.zeros(
            layers, num_groups, group_size, heads, dim // 2, dtype=torch.uint8, device=device
        )
        self.key_scale = torch.zeros(layers, num_groups, heads, dim, dtype=torch.float16, device=device)
        self.key_zero = torch.zeros_like(self.key_scale)  # [layers, W, KVH, D]
        self.value_codes = torch.zeros_like(self.key_codes)  # [layers, W, G, KVH, D/2]
        self.value_scale = torch.zeros(
            layers, num_groups, group_size, heads, value_groups, dtype=torch.float16, device=device
        )
        self.value_zero = torch.zeros_like(self.value_scale)  # [layers, W, G, KVH, D/VG]
        self.group_size = group_size
        self.num_groups = num_groups
        self._free: list[WarmGroupId] = [WarmGroupId(i) for i in range(num_groups - 1, -1, -1)]
        group_bytes = sum(
            t[:, 0].numel() * t.element_size()
            for t in (
                self.key_codes,
                self.key_scale,
                self.key_zero,
                self.value_codes,
                self.value_scale,
                self.value_zero,
            )
        )
        self._bytes_per_token = group_bytes // max(group_size, 1)

    @property
    def bytes_per_token(self) -> int:
        """Packed codes plus amortized scales and zeros, all layers."""
        return self._bytes_per_token

    def num_used_tokens(self) -> int:
        """Held groups times the group size."""
        return (self.num_groups - len(self._free)) * self.group_size

    def capacity_tokens(self) -> int:
        """Every group."""
        return self.num_groups * self.group_size

    def can_allocate(self) -> bool:
        """True when a group is free."""
        return bool(self._free)

    def allocate(self) -> WarmGroupId:
        """Take a free group (changes state)."""
        return self._free.pop()

    def free(self, group_id: WarmGroupId) -> None:
        """Return a group (changes state)."""
        self._free.append(group_id)

    def write(self, group_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `[layers, n, G, KVH, D]` keys/values into the `[n]` groups `group_ids`, all layers and
        groups in one set of launches (changes state)."""
        qk = kivi.quantize_keys(keys)  # codes [layers, n, G, KVH, D/2], scale/zero [layers, n, KVH, D]
        qv = kivi.quantize_values(values, self.group_size)  # scale/zero [layers, n, G, KVH, D/VG]
        self.key_codes[:, group_ids], self.key_scale[:, group_ids], self.key_zero[:, group_ids] = qk
        self.value_codes[:, group_ids], self.value_scale[:, group_ids], self.value_zero[:, group_ids] = qv

    def read_group(self, group_id: WarmGroupId) -> tuple[torch.Tensor, torch.Tensor]:
        """One group's keys and values dequantized, 2 x `[layers, G, KVH, D]` fp32 (reads only)."""
        keys = kivi.dequantize_keys(
            self.key_codes[:, group_id], self.key_scale[:, group_id], self.key_zero[:, group_id]
        )
        values = kivi.dequantize_values(
            self.value_codes[:, group_id], self.value_scale[:, group_id], self.value_zero[:, group_id]
        )
        return keys, values

    def layer_views(self, layer: int, block_size: int) -> WarmLayer:
        """One layer's tensors with each group of G tokens seen as G/BS warm blocks of BS (no copy)."""
        blocks = self.num_groups * (self.group_size // block_size)

        def by_block(t: torch.Tensor) -> torch.Tensor:
            return t[layer].view(blocks, block_size, *t.shape[3:])

        return WarmLayer(
            by_block(self.key_codes), self.key_scale[layer], self.key_zero[layer],
            by_block(self.value_codes), by_block(self.value_scale), by_block(self.value_zero),
        )  # fmt: skip


@dataclass(frozen=True)
class WarmCopy:
    """One hot -> warm demotion's device work: quantize these hot blocks into this warm group."""

    block_ids: tuple[BlockId, ...]
    group_id: WarmGroupId


@dataclass(frozen=True)
class ColdSource:
    """A group bound for the cold tier and where the runner reads it: its warm group, or the hot blocks
    of a demotion still pending (the group left warm in the step it entered) or refused for lack of room."""

    first_block: int
    warm_group: WarmGroupId | None = None
    hot_block_ids: tuple[BlockId, ...] = ()


@dataclass(frozen=True)
class DemotionResult:
    """Tokens one `demote` call moved hot -> warm, tokens it dropped from warm, and the groups that
    left for the cold tier (sequences that keep cold blocks only)."""

    num_demoted_tokens: int = 0
    num_dropped_tokens: int = 0
    to_cold: tuple[ColdSource, ...] = ()


NOTHING_DEMOTED = DemotionResult()  # what most calls return (a decode step mid-group)


class KVCache:
    """The hot and warm tiers of every layer: `store` writes new keys/values, the block calls plan."""

    def __init__(self, hot: HotTier, warm: WarmTier | None) -> None:
        self.hot = hot
        self.warm = warm
        # Demotions the scheduler decided, not yet carried out: the scheduler never touches the
        # device; the runner takes these into the next step's plan and every rank performs them.
        self.pending_warm_copies: list[WarmCopy] = []
        self.pending_cold = ColdMoves()  # the same for the cold tier (stores and loads)
        # A loaded prefix's copies (PrefixWriter, on the kvstore loader thread): their stream, and the
        # device buffer each chunk lands in before its scatter; both made on the first prefix hit.
        self._load_stream: torch.cuda.Stream | None = None
        self._landing: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        """Tokens per hot block."""
        return self.hot.block_size

    @property
    def blocks_per_group(self) -> int:
        """Hot blocks one warm group spans (1 with no warm tier)."""
        return 1 if self.warm is None else self.warm.group_size // self.block_size

    def hot_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's hot keys and values `[N, BS, KVH, D]`, for a kernel that writes them itself."""
        return self.hot.keys[layer], self.hot.values[layer]

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new `[T, KVH, D]` keys/values to their hot slots `[T]`; attention reads them in place."""
        self.hot.write(layer, keys, values, slot_mapping)

    # --- per-sequence block management ---------------------------------------------------------

    def num_blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """New hot blocks a table needs to hold positions `[0, num_tokens)`."""
        return max(0, -(-num_tokens // self.block_size) - len(table.hot_block_ids))

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        """True when `grow(table, num_tokens)` would succeed."""
        return self.hot.pool.can_allocate(self.num_blocks_needed(table, num_tokens))

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Allocate hot blocks so the table covers `[0, num_tokens)` (changes state)."""
        table.hot_block_ids.extend(self.hot.pool.allocate(self.num_blocks_needed(table, num_tokens)))

    def release(self, table: BlockTable) -> None:
        """Give back every block and warm group of a table at once (finish, cancel, preempt)."""
        self.hot.pool.free(table.held_hot_blocks())
        if self.warm is not None:
            for group_id in table.warm_groups.values():
                self.warm.free(group_id)
        table.hot_block_ids.clear()
        table.warm_groups.clear()
        table.num_registered_blocks = 0
        table.next_demote_block = -1
        table.num_dropped_blocks = 0
        table.cold_blocks.clear()
        table.aux_blocks.clear()

    def register_full_blocks(self, table: BlockTable, num_computed_tokens: int) -> list[int]:
        """Publish the prompt's blocks that are now computed to the prefix cache; returns their indexes."""
        num_full = min(num_computed_tokens // self.block_size, len(table.prefix_hashes))
        registered = []
        for index in range(table.num_registered_blocks, num_full):
            block_id = table.hot_block_ids[index]
            if block_id != SCRATCH_BLOCK:
                self.hot.pool.register(block_id, table.prefix_hashes[index])
                registered.append(index)
        table.num_registered_blocks = max(table.num_registered_blocks, num_full)
        return registered

    def demote(self, table: BlockTable, num_computed_tokens: int) -> DemotionResult:
        """Move whole groups that left the hot window to warm, then apply the warm limit."""
        tiers = table.tiers
        if not tiers.enabled or self.warm is None:
            return NOTHING_DEMOTED
        block_size = self.hot.block_size
        blocks_per_group = tiers.group_size // block_size
        if table.next_demote_block < 0:
            table.next_demote_block = self._num_sink_blocks(table)
        hot_from = max(num_computed_tokens - tiers.hot_tokens, table.hot_floor)  # >= hot_from stay hot
        if (table.next_demote_block + blocks_per_group) * block_size > hot_from:  # most steps
            return NOTHING_DEMOTED
        demoted, dropped, to_cold = 0, 0, list[ColdSource]()
        while (table.next_demote_block + blocks_per_group) * block_size <= hot_from:
            demoted += self._demote_group(table, table.next_demote_block, blocks_per_group, to_cold)
            table.next_demote_block += blocks_per_group
            # group by group, so a long prompt's newest groups find warm room the oldest just left
            dropped += self._apply_warm_limit(table, blocks_per_group, to_cold)
        return DemotionResult(demoted, dropped, tuple(to_cold))

    def grow_hot(self, table: BlockTable) -> bool:
        """One more group of hot window for this table, up to its cap; False at the cap (changes state)."""
        grown = table.tiers.grown()
        if grown is None:
            return False
        table.tiers = grown
        return True

    def num_held_hot_blocks(self, table: BlockTable) -> int:
        """`len(table.held_hot_blocks())` without scanning the table (read per row per decode step).

        Demotion empties blocks in order, from the end of the sink up to `next_demote_block`
        (to warm or dropped); every other block of the table is held.
        """
        if table.next_demote_block < 0:  # nothing demoted yet
            return len(table.hot_block_ids)
        return len(table.hot_block_ids) - (table.next_demote_block - self._num_sink_blocks(table))

    def _num_sink_blocks(self, table: BlockTable) -> int:
        return -(-table.tiers.sink_tokens // self.hot.block_size)

    def _demote_group(
        self, table: BlockTable, first: int, blocks_per_group: int, to_cold: list[ColdSource]
    ) -> int:
        assert self.warm is not None
        block_ids = table.hot_block_ids[first : first + blocks_per_group]
        if self.warm.can_allocate() and table.tiers.warm_tokens > 0:
            group_id = self.warm.allocate()
            self.pending_warm_copies.append(WarmCopy(tuple(block_ids), group_id))
            table.warm_groups[first] = group_id
        else:  # no warm room anywhere: the window policy drops the group, and says so in metrics
            table.num_dropped_blocks += blocks_per_group
            if table.keeps_cold:
                to_cold.append(ColdSource(first, hot_block_ids=tuple(block_ids)))
        self.hot.pool.free(block_ids)
        for index in range(first, first + blocks_per_group):
            table.hot_block_ids[index] = SCRATCH_BLOCK
        return blocks_per_group * self.block_size

    def copy_to_warm(self, copies: list[WarmCopy]) -> None:
        """Quantize hot blocks into their allocated warm groups: the device work of a step's demotions.

        On CUDA one fused launch quantizes every group in place (demote_kernel). Elsewhere the
        reference runs batched: a chunk of groups costs the same few launches as one group, so a long
        prompt's prefill (hundreds of demotions in one step) does not become a launch storm, and chunks
        keep the float temporaries near WARM_COPY_CHUNK_BYTES (changes state).
        """
        assert self.warm is not None or not copies
        if not copies:
            return
        assert self.warm is not None
        device = self.hot.keys.device
        if device.type == "cuda" and demote_kernel.supports(self.hot.keys, self.warm.group_size):
            warm = self.warm
            sources = torch.tensor([copy.block_ids for copy in copies], dtype=torch.int32)
            targets = torch.tensor([copy.group_id for copy in copies], dtype=torch.int32)
            demote_kernel.demote(
                self.hot.keys, self.hot.values,
                sources.pin_memory().to(device, non_blocking=True),
                targets.pin_memory().to(device, non_blocking=True),
                warm.key_codes, warm.key_scale, warm.key_zero,
                warm.value_codes, warm.value_scale, warm.value_zero,
            )  # fmt: skip
            return
        chunk = self.hot.warm_copy_chunk(self.warm.group_size)
        for start in range(0, len(copies), chunk):
            part = copies[start : start + chunk]
            block_ids = [b for copy in part for b in copy.block_ids]
            group_ids = torch.tensor([copy.group_id for copy in part], device=device)
            k, v = self.hot.read_blocks(block_ids)  # [layers, n*G, KVH, D]
            shape = (k.shape[0], len(part), self.warm.group_size, *k.shape[2:])
            self.warm.write(group_ids, k.view(shape), v.view(shape))

    def take_warm_copies(self) -> list[WarmCopy]:
        """The demotions decided since the last call; the runner carries them out on every rank."""
        copies, self.pending_warm_copies = self.pending_warm_copies, []
        return copies

    def _apply_warm_limit(self, table: BlockTable, blocks_per_group: int, to_cold: list[ColdSource]) -> int:
        """Free the oldest warm groups past the warm limit: dropped, or (`keeps_cold`) bound for cold.

        A group freed here is reused no earlier than the runner's next warm copies, which run after
        the cold reads; a group whose own warm copy is still pending goes cold from its hot blocks.
        """
        assert self.warm is not None
        dropped = 0
        while len(table.warm_groups) * table.tiers.group_size > table.tiers.warm_tokens:
            oldest = min(table.warm_groups)
            group_id = table.warm_groups.pop(oldest)
            self.warm.free(group_id)
            table.num_dropped_blocks += blocks_per_group
            dropped += table.tiers.group_size
            pending = self._take_pending_copy(group_id)
            if table.keeps_cold:
                source = (
                    ColdSource(oldest, group_id)
                    if pending is None
                    else ColdSource(oldest, hot_block_ids=pending.block_ids)
                )
                to_cold.append(source)
        return dropped

    def _take_pending_copy(self, group_id: WarmGroupId) -> WarmCopy | None:
        """Withdraw the pending demotion into `group_id`: the group left warm before it arrived."""
        for index in range(len(self.pending_warm_copies) - 1, -1, -1):
            if self.pending_warm_copies[index].group_id == group_id:
                return self.pending_warm_copies.pop(index)
        return None

    # --- the cold tier's device moves ----------------------------------------------------------

    def take_cold_moves(self) -> ColdMoves:
        """The cold-tier moves decided since the last call; the runner carries them out."""
        moves, self.pending_cold = self.pending_cold, ColdMoves()
        return moves

    def write_loaded(self, loads: list[ColdLoad]) -> None:
        """Write blocks back from the kvstore into their hot blocks, all layers (changes state)."""
        device = self.hot.keys.device
        for load in loads:
            if device.type == "cpu":
                self._copy_blocks(load.hot_block_ids, load.kv)
                continue
            step = max(1, LOAD_CHUNK_BYTES // (load.kv[0].numel() * load.kv.element_size()))
            for start in range(0, len(load.hot_block_ids), step):
                chunk = load.kv[start : start + step].to(device, non_blocking=True)
                index = torch.tensor(load.hot_block_ids[start : start + step], device=device)
                self._scatter_blocks(index, chunk)

    def prefix_writer(self, block_ids: tuple[BlockId, ...]) -> PrefixWriter:
        """A writer of a loaded prefix into `block_ids` (allocated, and owned by nobody else until the
        writer has finished), for the kvstore loader thread."""
        if self.hot.keys.device.type == "cuda" and self._load_stream is None:
            self._load_stream = torch.cuda.Stream(self.hot.keys.device)
        return PrefixWriter(self, block_ids, self._load_stream)

    def load_landing(self, dtype: torch.dtype) -> torch.Tensor:
        """The device buffer a loaded prefix's chunks land in, flat, LOAD_CHUNK_BYTES (at least one
        block); made once, by the first writer to need it, and kept."""
        block_bytes = self.hot.keys[:, 0].numel() * 2 * dtype.itemsize
        size = max(LOAD_CHUNK_BYTES, block_bytes) // dtype.itemsize
        if self._landing is None or self._landing.dtype != dtype or len(self._landing) < size:
            self._landing = torch.empty(size, dtype=dtype, device=self.hot.keys.device)
        return self._landing

    def _copy_blocks(self, block_ids: tuple[BlockId, ...], kv: torch.Tensor) -> None:
        """On the host, block by block: an index_put would convert the dtype into a temporary first
        (five times slower for an 8K-token prefix)."""
        for block_kv, block_id in zip(kv, block_ids, strict=True):  # [L, 2, BS, KVH, D]
            self.hot.keys[:, block_id].copy_(block_kv[:, 0])
            self.hot.values[:, block_id].copy_(block_kv[:, 1])

    def _scatter_blocks(self, index: torch.Tensor, kv: torch.Tensor) -> None:
        """On the device, one scatter per tensor: kv `[n, L, 2, BS, KVH, D]` into blocks `index`
        `[n]`, both already there."""
        dtype = self.hot.keys.dtype
        self.hot.keys[:, index] = kv[:, :, 0].transpose(0, 1).to(dtype)  # [L, n, BS, KVH, D]
        self.hot.values[:, index] = kv[:, :, 1].transpose(0, 1).to(dtype)


class PrefixWriter:
    """Writes a prefix's blocks into their hot blocks, piece by piece, as the kvstore loader thread
    gets them off the store: `write` block-major pieces `[n, L, 2, BS, KVH, D]` (BF16 on the host,
    pinned for a CUDA engine), then `finish`, after which every write has landed and the host pieces
    may be reused.

    On a GPU the copies run on a stream of their own, through one landing buffer of LOAD_CHUNK_BYTES
    on the device (a chunk goes up, then is scattered into its blocks), so the copy of one piece
    overlaps the reads of the next and a hit pays only for the last piece's copy. The blocks are the
    writer's alone while it writes (nothing maps them yet), and its first write waits (`wait_for`)
    for the device work queued before they were handed to it, which may still read or write them
    (ColdTier.submit_after_moves); the engine maps them only after `finish`. On the CPU a write
    copies at once: there that work has run before the load starts.
    """

    def __init__(
        self, cache: KVCache, block_ids: tuple[BlockId, ...], stream: torch.cuda.Stream | None
    ) -> None:
        self.block_ids = block_ids
        self._cache = cache
        self._stream = stream
        self._index: torch.Tensor | None = None  # block_ids on the device (made on the first write)

    def write(self, first: int, kv: torch.Tensor) -> None:
        """Blocks `[first, first + n)` of the prefix, `kv` `[n, L, 2, BS, KVH, D]` on the host; the
        host memory must stay as it is until `finish`."""
        block_ids = self.block_ids[first : first + len(kv)]
        if not block_ids:
            return
        if self._stream is None:
            self._cache._copy_blocks(block_ids, kv)
            return
        with torch.cuda.stream(self._stream):
            if self._index is None:  # from pinned memory: the copy queues, the thread goes on
                ids = torch.tensor(self.block_ids, dtype=torch.long).pin_memory()
                self._index = ids.to(self._cache.hot.keys.device, non_blocking=True)
            step = max(1, LOAD_CHUNK_BYTES // (kv[0].numel() * kv.element_size()))
            for start in range(0, len(block_ids), step):
                part = kv[start : start + step]
                landing = self._landing_for(part)
                landing.copy_(part, non_blocking=True)
                index = self._index[first + start : first + start + len(part)]
                self._cache._scatter_blocks(index, landing)

    def _landing_for(self, part: torch.Tensor) -> torch.Tensor:
        """A device view shaped like `part` over the cache's landing buffer."""
        return self._cache.load_landing(part.dtype)[: part.numel()].view(part.shape)

    def wait_for(self, fence: torch.cuda.Event) -> None:
        """Make every write go after the device work `fence` ends: work the engine queued on these
        blocks before they were freed and allocated to this prefix (ColdTier.submit_after_moves)."""
        if self._stream is not None:
            self._stream.wait_event(fence)

    def finish(self) -> None:
        """Block until every write has landed in the cache."""
        if self._stream is not None:
            self._stream.synchronize()


def queued_copies(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on `device`'s current stream (None on the CPU, where
    copies are done when they return). Recorded on `device`, which need not be the current GPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
