"""KVCache on a 1-head fake config: paged scatter/gather, masks, demotion to INT4, window and drops."""

from __future__ import annotations

import pickle
import random

import torch

from services.engine.attention.metadata import AttentionMetadata, HostMetadata, RowInput
from services.engine.attention.reference import dense_context
from services.engine.kv import kivi
from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockId
from services.engine.kv.block_table import BlockTable, WarmGroupId, WarmGroups
from services.engine.kv.cold_moves import ColdLoad
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig
from tests.engine.paged_helpers import CPU, ONE_HEAD, make_cache


def _packed(rows: list[list[float]], lengths: list[int]) -> torch.Tensor:
    values = [v for row, n in zip(rows, lengths, strict=True) for v in row[:n]]
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 2)  # [T, 1, D]


def _store(cache, tables, rows: list[list[float]], starts: list[int], lengths: list[int]):  # type: ignore[no-untyped-def]
    """Write each row's new values as keys and values; return the reference's dense view of layer 0."""
    cache.copy_to_warm(cache.take_warm_copies())  # the demotions since the last step, as in the runner
    for table, start, n in zip(tables, starts, lengths, strict=True):
        cache.grow(table, start + n)
    inputs = [RowInput(t, s, n) for t, s, n in zip(tables, starts, lengths, strict=True)]
    metadata = AttentionMetadata.for_rows(inputs, cache.block_size, cache.blocks_per_group, CPU)
    cache.store(0, _packed(rows, lengths), _packed(rows, lengths), metadata.slot_mapping)
    return dense_context(cache, 0, metadata)


def test_store_scatters_into_blocks_and_the_reference_gathers_each_row_densely() -> None:
    cache = make_cache(ONE_HEAD, num_blocks=8, block_size=2)
    tables = [BlockTable(TierConfig()), BlockTable(TierConfig())]
    context = _store(cache, tables, [[1, 2, 3], [4, 5, 0]], [0, 0], [3, 2])  # row 1 is shorter
    assert context.keys.shape == (2, 1, 3, 2)  # [B, KVH, L, D]
    assert context.keys[0, 0, :, 0].tolist() == [1, 2, 3]
    assert context.visible[1, 0, 1].tolist() == [True, True, False]  # past the row's end: never visible
    assert tables[0].hot_block_ids != tables[1].hot_block_ids
    context = _store(cache, tables, [[7], [8]], [3, 2], [1, 1])  # rows at different lengths
    assert context.keys[0, 0, :, 0].tolist() == [1, 2, 3, 7]
    assert context.keys[1, 0, :3, 0].tolist() == [4, 5, 8]
    assert context.visible[1, 0, 0].tolist() == [True, True, True, False]


def test_kivi_round_trip_error_is_within_half_a_step() -> None:
    x = torch.randn(32, 3, 8, generator=torch.Generator().manual_seed(0))  # [G, KVH, D]
    qk = kivi.quantize_keys(x)
    assert qk.codes.dtype == torch.uint8 and qk.codes.shape == (32, 3, 4) and qk.scale.dtype == torch.float16
    keys = kivi.dequantize_keys(qk.codes[None], qk.scale[None], qk.zero[None])[0]
    assert ((keys - x).abs() <= kivi.key_params_natural(qk.scale).float() / 2 + 1e-2).all()  # per channel
    qv = kivi.quantize_values(x, group_size=4)
    assert qv.scale.shape == (32, 3, 2)  # per token, two groups of 4 channels
    values = kivi.dequantize_values(qv.codes[None], qv.scale[None], qv.zero[None])[0]
    step = qv.scale.float().repeat_interleave(4, dim=-1)
    assert ((values - x).abs() <= step / 2 + 1e-2).all()
    assert (kivi.unpack_int4(kivi.pack_int4(torch.arange(16).view(1, 16))) == torch.arange(16)).all()


def test_key_parameters_are_stored_as_the_fused_kernel_pairs_them() -> None:
    """Slot 2 (j * D/8 + w) + h holds channel 8w + j + 4h: the pairs one word's unpacked codes form,
    pair j of every word side by side (kivi.key_param_channels)."""
    assert kivi.key_param_channels(16).tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    assert kivi.key_param_channels(12).tolist() == list(range(12))  # not a multiple of 8: channel order
    channels = torch.arange(128.0).expand(2, 128)
    assert (kivi.key_params_natural(kivi.key_params_stored(channels)) == channels).all()
    keys = torch.arange(16.0).repeat(2, 1).unsqueeze(1)  # [G=2, KVH=1, D=16]: key k in channel k
    keys[1] += 15 * (torch.arange(16.0) + 1)  # channel c spans 15 (c + 1): its scale is c + 1
    assert kivi.quantize_keys(keys).scale[0].tolist() == (kivi.key_param_channels(16) + 1).tolist()
    # the gather index is made once per (head dim, device): rebuilt per call, a GPU prefill would
    # copy it from the host on every layer, and each copy waits for the stream
    assert kivi._key_param_index(128, torch.device("cpu"), stored=False) is kivi._key_param_index(
        128, torch.device("cpu"), stored=False
    )


def test_demotion_moves_groups_out_of_the_hot_window_and_frees_their_blocks() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=8, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    rows = [[float(i) for i in range(14)]]
    _store(cache, [table], rows, [0], [14])
    assert cache.hot.pool.num_used_blocks() == 7
    result = cache.demote(table, 14)
    # sink block 0 stays; groups [2,6) and [6,10) go warm; [10,14) is the hot window
    assert result.num_demoted_tokens == 8 and sorted(table.warm_groups) == [1, 3]
    assert table.hot_block_ids[1:5] == [SCRATCH_BLOCK] * 4
    assert cache.hot.pool.num_used_blocks() == 3
    assert cache.warm is not None and cache.warm.num_used_tokens() == 8
    context = _store(cache, [table], [[14.0]], [14], [1])
    assert context.visible[0, 0, 0].all()  # every position is visible: sink, warm, hot
    torch.testing.assert_close(context.keys[0, 0, :, 0], torch.arange(15.0), atol=0.2, rtol=0)  # INT4 error


def test_demote_only_plans_and_the_copy_happens_when_taken() -> None:
    """The scheduler's demote never touches the device: the quantize runs when the runner takes the copy."""
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=8, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    _store(cache, [table], [[float(i + 1) for i in range(14)]], [0], [14])
    cache.demote(table, 14)
    assert cache.warm is not None and not cache.warm.key_scale.any()  # nothing written yet
    copies = cache.take_warm_copies()
    assert [c.group_id for c in copies] == sorted(table.warm_groups.values())
    assert cache.take_warm_copies() == []
    cache.copy_to_warm(copies)
    assert cache.warm.key_scale.any()


def test_a_batched_demotion_writes_what_one_group_at_a_time_writes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Many groups quantized in one call (and split into chunks) equal the same groups done singly."""
    tiers = TierConfig(enabled=True, sink_tokens=0, hot_tokens=2, warm_tokens=64, group_size=4)
    values = torch.randn(42, generator=torch.Generator().manual_seed(0)).tolist()
    written = []
    for chunk_bytes in (1 << 30, 1):  # one chunk for all groups, then one group per chunk
        monkeypatch.setattr("services.engine.kv.cache.WARM_COPY_CHUNK_BYTES", chunk_bytes)
        cache = make_cache(ONE_HEAD, num_blocks=32, block_size=2, tiers=tiers)
        table = BlockTable(tiers)
        _store(cache, [table], [values], [0], [42])
        cache.demote(table, 42)
        assert len(cache.pending_warm_copies) == 10
        cache.copy_to_warm(cache.take_warm_copies())
        assert cache.warm is not None
        warm = cache.warm
        written.append([t.clone() for t in (warm.key_codes, warm.key_scale, warm.value_zero)])
    for batched, single in zip(*written, strict=True):
        assert torch.equal(batched, single)
    assert written[0][1].any()


def test_the_held_hot_block_count_matches_a_scan_through_demotions_and_drops() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=3, hot_tokens=4, warm_tokens=4, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=32, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    assert cache.num_held_hot_blocks(table) == len(table.held_hot_blocks()) == 0
    for length in range(1, 30):
        _store(cache, [table], [[float(length - 1)]], [length - 1], [1])
        cache.demote(table, length)
        assert cache.num_held_hot_blocks(table) == len(table.held_hot_blocks())
    assert table.num_dropped_blocks > 0 and table.warm_groups  # both kinds of emptied block occurred


def test_window_policy_drops_the_oldest_warm_group() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=4, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    _store(cache, [table], [[float(i) for i in range(14)]], [0], [14])
    result = cache.demote(table, 14)
    assert result.num_dropped_tokens == 4 and list(table.warm_groups) == [3]
    visible = _store(cache, [table], [[14.0]], [14], [1]).visible[0, 0, 0].tolist()
    assert visible == [True] * 2 + [False] * 4 + [True] * 9  # positions 2..5 dropped, sink kept


def test_release_returns_hot_blocks_and_warm_groups() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=0, hot_tokens=2, warm_tokens=8, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    _store(cache, [table], [[float(i) for i in range(10)]], [0], [10])
    cache.demote(table, 10)
    assert cache.warm is not None and cache.warm.num_used_tokens() == 8
    cache.release(table)
    assert cache.hot.pool.num_used_blocks() == 0 and cache.warm.num_used_tokens() == 0


def test_tier_bytes_per_token() -> None:
    config = ModelConfig(
        vocab_size=4,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
    )
    tiers = TierConfig(enabled=True, group_size=32)
    cache = make_cache(config, tiers=tiers)
    assert cache.hot.bytes_per_token == 2 * 2 * 2 * 64 * 4  # K+V, layers, heads, dim, fp32
    assert cache.warm is not None
    # codes: 2 x 64/2 bytes per head; key scale+zero: 2 x 2 x 64 bytes per head per 32 tokens;
    # value scale+zero: 2 x 2 bytes per head per token (one 32-channel... two groups of 32)
    per_head = 2 * 32 + (2 * 2 * 64) / 32 + 2 * 2 * 2
    assert cache.warm.bytes_per_token == int(2 * 2 * per_head)


def test_a_grown_hot_window_keeps_more_tokens_hot_up_to_its_cap() -> None:
    tiers = TierConfig(
        enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=16, group_size=4, max_hot_tokens=8
    )
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    _store(cache, [table], [[float(i) for i in range(14)]], [0], [14])
    assert cache.grow_hot(table) and table.tiers.hot_tokens == 8
    assert not cache.grow_hot(table)  # at the cap
    result = cache.demote(table, 14)
    # the sink block stays; only [2, 6) leaves: the grown window keeps [6, 14) hot
    assert result.num_demoted_tokens == 4 and sorted(table.warm_groups) == [1]


def test_a_turn_boundary_restarts_the_hot_window_there() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=8, warm_tokens=16, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=16, block_size=2, tiers=tiers)
    table = BlockTable(tiers)
    _store(cache, [table], [[float(i) for i in range(14)]], [0], [14])
    table.hot_floor = 10  # a new conversation starts at position 10
    result = cache.demote(table, 14)
    # without the boundary only [2, 6) would leave (hot 8 keeps [6, 14)); now [6, 10) leaves too
    assert result.num_demoted_tokens == 8 and sorted(table.warm_groups) == [1, 3]


def test_a_long_prefill_keeps_its_newest_warm_groups_and_sends_the_rest_cold_from_hot() -> None:
    """Groups that enter and leave warm in one step go cold from their hot blocks, never from an
    unwritten warm group; the warm pool (just what one sequence needs) holds the newest groups."""
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=8, group_size=4)
    cache = make_cache(ONE_HEAD, num_blocks=20, block_size=2, tiers=tiers, num_warm_groups=3)
    table = BlockTable(tiers, keeps_cold=True)
    _store(cache, [table], [[float(i) for i in range(30)]], [0], [30])
    hot_ids = list(table.hot_block_ids)
    result = cache.demote(table, 30)
    # sink block 0; six groups [2, 26) leave hot; the newest two stay warm, four go cold
    assert sorted(table.warm_groups) == [9, 11]
    assert [s.first_block for s in result.to_cold] == [1, 3, 5, 7]
    assert all(s.warm_group is None for s in result.to_cold)
    assert [s.hot_block_ids for s in result.to_cold] == [tuple(hot_ids[f : f + 2]) for f in (1, 3, 5, 7)]
    copies = cache.take_warm_copies()  # only the surviving groups are quantized
    assert sorted(c.block_ids for c in copies) == [tuple(hot_ids[9:11]), tuple(hot_ids[11:13])]


def test_the_warm_tables_follow_every_change_to_a_rows_warm_groups() -> None:
    """The step metadata keeps each row's warm blocks as arrays until its groups change: after each
    kind of change (a group added out of order or after the others, replaced, evicted, all cleared)
    the tables equal a fresh table's."""
    table = BlockTable(TierConfig(enabled=True))
    table.hot_block_ids = [SCRATCH_BLOCK] * 12

    def warm_row() -> list[int]:
        metadata = HostMetadata.build([RowInput(table, 23, 1)], block_size=2, blocks_per_group=2)
        return metadata.warm_block_tables[0].tolist()

    def expected() -> list[int]:  # from the groups as they are now, with no arrays kept
        row = [-1] * 12
        for first, group in table.warm_groups.items():
            row[first : first + 2] = [2 * group, 2 * group + 1]
        return row

    table.warm_groups[4] = WarmGroupId(3)
    table.warm_groups[0] = WarmGroupId(5)  # added out of logical order
    assert warm_row() == expected() == [10, 11, -1, -1, 6, 7] + [-1] * 6
    table.warm_groups[4] = WarmGroupId(1)  # the same blocks, another group
    assert warm_row() == expected()
    table.warm_groups[8] = WarmGroupId(2)  # after every other group: the kept arrays are extended
    assert warm_row() == expected() == [10, 11, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1]
    table.warm_groups[6] = WarmGroupId(0)  # between two groups: built again
    assert warm_row() == expected()
    table.warm_groups.pop(6)
    table.warm_groups.pop(8)
    table.warm_groups.pop(0)
    assert warm_row() == expected() == [-1] * 4 + [2, 3] + [-1] * 6
    table.warm_groups.clear()
    assert warm_row() == [-1] * 12


def test_warm_groups_survive_the_pickle_that_carries_a_plan_to_the_other_ranks() -> None:
    """Unpickling sets a dict subclass's items before its attributes (tensor parallelism sends each
    step's tables to the other ranks this way): the copy has the same groups and the same arrays."""
    groups = WarmGroups({0: WarmGroupId(3), 2: WarmGroupId(5)})
    groups.block_arrays(2)  # kept arrays travel too
    groups[4] = WarmGroupId(1)  # extended in place
    copy = pickle.loads(pickle.dumps(groups))
    assert dict(copy) == dict(groups)
    for ours, theirs in zip(copy.block_arrays(2), groups.block_arrays(2), strict=True):
        assert ours.tolist() == theirs.tolist()
    assert copy.block_arrays(2)[1].tolist() == [6, 7, 10, 11, 2, 3]


def test_the_step_tables_of_a_batch_equal_each_rows_own_tables() -> None:
    """The step metadata fills every row's hot and warm tables in one scatter each: they equal tables
    built row by row, for rows of different lengths, rows holding blocks past the step's width (only
    its first `width` are read), demoted (scratch) blocks, warm groups past the width, and empty rows."""
    generator = random.Random(7)
    block_size, blocks_per_group = 4, 2
    tables, inputs = [], []
    for _ in range(40):
        table = BlockTable(TierConfig(enabled=True))
        num_blocks = generator.randrange(0, 30)
        table.hot_block_ids = [BlockId(generator.randrange(1, 500)) for _ in range(num_blocks)]
        for first in range(0, num_blocks - 1, blocks_per_group):
            if generator.random() < 0.4:
                table.warm_groups[first] = WarmGroupId(generator.randrange(0, 100))
                table.hot_block_ids[first : first + blocks_per_group] = [SCRATCH_BLOCK] * blocks_per_group
        # a row's tokens end inside its blocks, or short of them (blocks reserved past the step)
        end = generator.randrange(1, max(2, num_blocks * block_size + 1))
        tables.append(table)
        inputs.append(RowInput(table, end - 1, 1))
    host = HostMetadata.build(inputs, block_size, blocks_per_group)
    width = host.block_tables.shape[1]
    assert width == -(-max(row.start + row.num_new for row in inputs) // block_size)
    for i, table in enumerate(tables):
        hot = table.hot_block_ids[:width]
        assert host.block_tables[i].tolist() == hot + [SCRATCH_BLOCK] * (width - len(hot))
        warm = [-1] * width
        for first, group in table.warm_groups.items():
            for offset in range(blocks_per_group):
                if first + offset < width:
                    warm[first + offset] = group * blocks_per_group + offset
        assert host.warm_block_tables[i].tolist() == warm


def test_loaded_blocks_land_the_same_through_the_host_copy_and_the_device_scatter() -> None:
    """`write_loaded` copies block by block on the host and scatters per chunk on a device; both
    put block i of a block-major `[n, L, 2, BS, KVH, D]` load into hot block `ids[i]`, all layers."""
    config = ModelConfig(
        vocab_size=4, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2, num_kv_heads=2,
        head_dim=4,
    )  # fmt: skip
    host, device = (make_cache(config, num_blocks=8, block_size=4) for _ in range(2))
    kv = torch.randn(3, 3, 2, 4, 2, 4).to(torch.bfloat16)  # [n, L, 2, BS, KVH, D]
    block_ids = (BlockId(5), BlockId(2), BlockId(6))
    host.write_loaded([ColdLoad(block_ids, kv)])
    device._scatter_blocks(block_ids, kv)  # the CUDA branch's scatter, run on the host
    for cache in (host, device):
        for position, block_id in enumerate(block_ids):
            assert torch.equal(cache.hot.keys[:, block_id], kv[position, :, 0].float())
            assert torch.equal(cache.hot.values[:, block_id], kv[position, :, 1].float())
        assert not cache.hot.keys[:, [0, 1, 3, 4, 7]].any()
    keys, values = kv[1, :, 0], kv[1, :, 1]  # a window block's tokens `[L, BS, KVH, D]`
    host.write_loaded([ColdLoad.of_tokens((BlockId(7),), keys, values)])
    assert torch.equal(host.hot.keys[:, 7], keys.float())
    assert torch.equal(host.hot.values[:, 7], values.float())


def test_a_mixed_steps_rows_split_into_its_decode_rows_and_its_chunks() -> None:
    """`num_leading_decode_rows` finds the decode rows a mixed step puts first, and `row_range` gives a
    range of rows the metadata they would have as a step of their own."""
    cache = make_cache(ONE_HEAD, 32, 4)
    tables = [BlockTable(TierConfig()) for _ in range(4)]
    rows = [
        RowInput(tables[0], 9, 1),
        RowInput(tables[1], 5, 1),
        RowInput(tables[2], 0, 7),
        RowInput(tables[3], 8, 3),
    ]
    for table, row in zip(tables, rows, strict=True):
        cache.grow(table, row.start + row.num_new)
    host = HostMetadata.build(rows, block_size=4, blocks_per_group=1)
    assert host.num_leading_decode_rows() == 2
    for first, end in ((0, 2), (2, 4), (1, 3)):
        part = host.row_range(first, end)
        alone = HostMetadata.build(rows[first:end], block_size=4, blocks_per_group=1)
        for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens"):
            assert getattr(part, name).tolist() == getattr(alone, name).tolist(), name
        width = alone.block_tables.shape[1]  # the step's tables may be wider: past a row's end is unread
        assert part.block_tables[:, :width].tolist() == alone.block_tables.tolist()
        assert (part.max_query_len, part.max_seq_len) == (alone.max_query_len, alone.max_seq_len)
    # a decode step, and a step whose first row is a chunk, have no leading decode rows to split off
    decode = HostMetadata.build(rows[:2], block_size=4, blocks_per_group=1)
    assert decode.num_leading_decode_rows() == 0
    assert HostMetadata.build(rows[2:], block_size=4, blocks_per_group=1).num_leading_decode_rows() == 0
