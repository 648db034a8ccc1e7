"""Token pruning in the cold tier: the key-norm proxy, which blocks are pruned, and what attention sees.

Unit tests of the proxy and of `_decode` run on small tensors; a pruned block's layout goes through
both attention backends (Triton in its CPU interpreter). The rest runs against a real kvstore
process over a real redis-server (the fixture and helpers of test_cold_tier.py): a demoted block is
pruned, a prompt block never is, and a pruned block in the auxiliary window is attended as its
kept tokens only, with no attention weight on a dropped one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from services.common.kv_codec.codec import CodecSettings, SparsityRule, decode_block, encode_block
from services.common.kv_codec.sparsity import attention_entropy
from services.common.kvstore_api import BlockHash, BlockSource, Codec, FetchedBlock, MissReason
from services.engine.attention.metadata import AttentionMetadata, RowInput
from services.engine.attention.reference import ReferenceBackend, dense_context
from services.engine.attention.triton_backend import TritonBackend
from services.engine.config import EngineConfig
from services.engine.kv.block_pool import SCRATCH_BLOCK
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cold_moves import ColdLoad
from services.engine.kv.cold_tier import (
    DEFAULT_TENANT,
    BlockToStore,
    ColdTier,
    ColdTierConfig,
    Degradation,
    Job,
    Operation,
    Outcome,
    _decode,
    key_norm_mass,
)
from services.engine.kv.prefix_fetch import PrefixLayout
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector
from tests.engine.kv.test_cold_tier import (
    BLOCK_SIZE,
    HEALTHY,
    STORY,
    kvstore,
    load_engine,
    long_prompt,
    prompt_block_hashes,
    run,
    step_until_a_window_loads,
)
from tests.engine.paged_helpers import CPU, make_cache
from tests.kvstore.conftest import KVStoreProcess

__all__ = ["kvstore"]  # the fixture, imported for the tests below

# Every block whose key norms differ at all keeps half its tokens (a 32-token group: one page of 16).
HALF = CodecSettings(sparsity=SparsityRule(low_entropy=0.0, high_entropy=1.0, mid_keep_ratio=0.5))
# Groups of two pages, so that a pruned group keeps one: sink 4, hot 32, warm one group.
PAGED_TIERS = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=32, group_size=32)
LAYERS, TOKENS, HEADS, DIM = 2, 32, 2, 8


def low_norm_block(low_tokens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[L, T, KVH, D]` whose keys at `low_tokens` are a tenth of the others' norm."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=generator) + 4.0
    keys[:, low_tokens] *= 0.1
    values = torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=generator)
    return keys, values


# --- the proxy -------------------------------------------------------------------------------------


def test_key_norm_mass_is_a_distribution_that_favours_low_norm_keys() -> None:
    keys, _ = low_norm_block([3, 17])
    mass = key_norm_mass(keys)
    assert mass.shape == (TOKENS,) and math.isclose(float(mass.sum()), 1.0, rel_tol=1e-5)
    assert set(torch.topk(mass, 2).indices.tolist()) == {3, 17}


def test_key_norm_mass_orders_tokens_by_norm_within_one_head() -> None:
    norms = torch.tensor([5.0, 1.0, 3.0, 2.0])
    keys = torch.zeros(1, 4, 1, 4)
    keys[0, :, 0, 0] = norms  # one channel carries the whole norm
    mass = key_norm_mass(keys)
    assert mass.argsort(descending=True).tolist() == norms.argsort().tolist()
    z = (norms - norms.mean()) / norms.std(correction=0)
    assert torch.allclose(mass, torch.softmax(-z, dim=0))
    assert torch.allclose(key_norm_mass(keys * 10), mass)  # free of the norms' scale


def test_equal_key_norms_give_even_mass_and_the_rule_keeps_every_token() -> None:
    generator = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(LAYERS, TOKENS, HEADS, DIM, generator=generator), dim=-1)
    mass = key_norm_mass(keys)
    assert torch.allclose(mass, torch.full((TOKENS,), 1 / TOKENS), rtol=1e-3)
    assert attention_entropy(mass) > 0.9999  # the rule's keep-all branch at any threshold below 1


def test_pruning_is_a_setting_and_off_by_default() -> None:
    assert not EngineConfig.from_env({}).cold.prune_tokens
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_COLD_PRUNE_TOKENS": "true"}).cold.prune_tokens


# --- _decode -----------------------------------------------------------------------------------------


def fetched(payload: bytes) -> FetchedBlock:
    return FetchedBlock("h", Codec.INT2_SPARSE, (LAYERS, 2, TOKENS, HEADS, DIM), payload, BlockSource.DISK)


def test_decode_takes_a_pruned_block_for_a_window_only_when_its_kept_tokens_fill_pages() -> None:
    keys, values = low_norm_block(list(range(16)))
    paged = dataclasses.replace(HALF.sparsity, keep_multiple=16)
    payload = encode_block(keys, values, key_norm_mass(keys), dataclasses.replace(HALF, sparsity=paged))
    window = _decode(fetched(payload), page_tokens=16)
    assert window is not None
    decoded = decode_block(payload)
    assert torch.equal(decoded.token_mask, torch.arange(TOKENS) < 16)  # the low-norm half
    assert torch.equal(window[0], decoded.keys) and window[0].shape[1] == 16
    assert _decode(fetched(payload), page_tokens=32) is None  # 16 kept tokens cannot fill a page of 32


def test_decode_still_refuses_a_corrupt_block() -> None:
    keys, values = low_norm_block(list(range(16)))
    payload = bytearray(encode_block(keys, values, key_norm_mass(keys), HALF))
    assert _decode(fetched(bytes(payload)), page_tokens=16) is not None
    payload[20] ^= 0xFF  # the kept-token bitmask now disagrees with the header's count
    assert _decode(fetched(bytes(payload)), page_tokens=16) is None
    assert _decode(fetched(bytes(payload[:40])), page_tokens=16) is None  # truncated


# --- the two attention backends ------------------------------------------------------------------


def test_both_backends_give_the_dropped_half_of_a_pruned_block_no_weight() -> None:
    """A pruned cold group as the window maps it (its 16 kept tokens in one page, the group's
    second page unmapped) between a hot sink block and a hot recent block: the reference gather and
    the Triton kernel (its CPU interpreter here) both attend exactly the 48 mapped tokens."""
    config = ModelConfig(
        vocab_size=4, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16,
    )  # fmt: skip
    cache = make_cache(config, num_blocks=8, block_size=BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    cache.hot.keys.normal_(generator=generator)
    cache.hot.values.normal_(generator=generator)
    table = BlockTable(TierConfig())
    cache.grow(table, 4 * BLOCK_SIZE)  # blocks 0 (sink), 1-2 (the cold group), 3 (recent)
    kept = torch.randn(2, 1, BLOCK_SIZE, 2, 16, generator=generator)  # keys, values [L, K, KVH, D]
    cache.write_loaded([ColdLoad.of_tokens((table.hot_block_ids[1],), kept[0], kept[1])])
    table.hot_block_ids[2] = SCRATCH_BLOCK  # the dropped half: no page

    query = torch.randn(1, 4, 16, generator=generator)  # one decode token [T, H, D]
    metadata = AttentionMetadata.for_rows([RowInput(table, 4 * BLOCK_SIZE - 1, 1)], BLOCK_SIZE, 1, CPU)
    mapped = [table.hot_block_ids[i] for i in (0, 1, 3)]
    keys = cache.hot.keys[0, mapped].flatten(0, 1)  # [48, KVH, D]
    values = cache.hot.values[0, mapped].flatten(0, 1)
    expected = dense_attention(query[0], keys, values)  # [H, D]
    reference = ReferenceBackend(cache).forward(query, query, query, 0, metadata)[0]
    fused = TritonBackend(cache, num_heads=4, max_decode_rows=1).forward(query, query, query, 0, metadata)[0]
    assert torch.allclose(reference, expected, atol=1e-5)
    assert torch.allclose(fused, expected, atol=1e-4)
    # what "zero key, zero value" for the dropped tokens would have given instead
    zeros = torch.zeros(BLOCK_SIZE, 2, 16)
    padded = dense_attention(query[0], torch.cat([keys, zeros]), torch.cat([values, zeros]))
    assert not torch.allclose(padded, expected, atol=1e-3)


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one token's query `[H, D]` over keys/values `[N, KVH, D]` (GQA) -> `[H, D]`."""
    groups = query.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, N, D]
    v = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    weights = (query.unsqueeze(1) @ k.transpose(-1, -2) / query.shape[-1] ** 0.5).softmax(-1)  # [H, 1, N]
    return (weights @ v)[:, 0]


# --- against a real kvstore ------------------------------------------------------------------------


def run_job(tier: ColdTier, job: Job) -> Outcome:
    """Submit one job and wait for its outcome (the tier's own barrier)."""
    tier.submit(job)
    tier.flush()
    (outcome,) = tier.take_outcomes()
    return outcome


def test_only_demoted_blocks_are_pruned_and_a_pruned_block_loads_as_its_kept_tokens(
    kvstore: KVStoreProcess,
) -> None:
    config = ColdTierConfig(target=kvstore.target, prune_tokens=True, codec=HALF, **HEALTHY)
    tier = ColdTier(config, "m", page_tokens=16)
    low = [1, 2, 3, 5, 8, 13, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    keys, values = low_norm_block(low)
    blocks = {
        operation: BlockToStore(BlockHash(name), keys, values, Codec.INT2_SPARSE)
        for operation, name in ((Operation.DEMOTE, "d0" * 8), (Operation.STORE_PREFIX, "f0" * 8))
    }
    for operation, block in blocks.items():
        assert run_job(tier, Job(operation, None, "", (), blocks=(block,))).stored == (block.block_hash,)
    names = tuple(blocks)
    with kvstore.client(DEFAULT_TENANT, "m") as client:
        served = client.get([b.block_hash for b in blocks.values()])
    masks = {op: decode_block(served[blocks[op].block_hash].payload).token_mask for op in names}  # type: ignore[union-attr]
    assert masks[Operation.DEMOTE].nonzero().flatten().tolist() == low  # the low-norm tokens stay
    assert bool(masks[Operation.STORE_PREFIX].all())  # the same block put as a prompt block: whole

    demoted = blocks[Operation.DEMOTE].block_hash
    window = run_job(tier, Job(Operation.LOAD_WINDOW, None, "", (), hashes=(demoted,)))
    assert window.degraded is None
    (loaded,) = window.loaded
    assert loaded.keys.shape == (LAYERS, 16, HEADS, DIM)
    kept = keys[:, low]
    half_step = (kept.amax(1, keepdim=True) - kept.amin(1, keepdim=True)) / 6  # INT2 over the kept 16
    assert bool(((loaded.keys - kept).abs() <= half_step + 1e-2).all())
    layout = PrefixLayout((LAYERS, 2, TOKENS, HEADS, DIM))
    written: list[torch.Tensor] = []
    sink = SimpleNamespace(write=lambda first, kv: written.append(kv), finish=lambda: None)
    prefix = run_job(
        tier, Job(Operation.LOAD_PREFIX, None, "", (), hashes=(demoted,), layout=layout, sink=sink)
    )
    assert prefix.degraded is Degradation.CORRUPT and prefix.prefix_blocks == 0  # a prefix is raw, whole
    assert not written
    tier.close()


def test_pruning_off_keeps_every_token_of_a_demoted_block(kvstore: KVStoreProcess) -> None:
    tier = ColdTier(ColdTierConfig(target=kvstore.target, codec=HALF, **HEALTHY), "m", page_tokens=16)
    keys, values = low_norm_block(list(range(16)))
    block = BlockToStore(BlockHash("d0" * 8), keys, values, Codec.INT2_SPARSE)
    run_job(tier, Job(Operation.DEMOTE, None, "", (), blocks=(block,)))
    (loaded,) = run_job(tier, Job(Operation.LOAD_WINDOW, None, "", (), hashes=(block.block_hash,))).loaded
    assert loaded.keys.shape == keys.shape
    tier.close()


def test_a_pruned_window_block_is_attended_as_its_kept_tokens_only(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """The engine's own demotion, store, window load and reference attention, end to end."""
    engine = load_engine(stories_hf_dir, pruning_config(kvstore), PAGED_TIERS)
    assert engine.cold is not None
    prompt = engine.tokenizer.encode(STORY * 2)
    collector = ResultCollector(prompt)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    engine.submit(prompt, params, collector, retrieval_mode="semantic")
    step_until_a_window_loads(engine, collector)
    engine.step()  # the load is written into its pages by the latest launch
    assert not collector.done.is_set() and not engine.runner.kv_cache.pending_cold.loads
    (seq,) = engine.scheduler.running
    table, cache = seq.block_table, engine.runner.kv_cache
    ((first, pages),) = table.aux_blocks.items()
    assert len(pages) == 1  # half of a two-page group: one page mapped, the other left unmapped
    assert table.hot_block_ids[first : first + 2] == [pages[0], SCRATCH_BLOCK]

    with kvstore.client(DEFAULT_TENANT, engine.model_id) as client:
        name = BlockHash(table.cold_blocks[first].block_hash)
        stored = decode_block(client.get([name])[name].payload)  # type: ignore[union-attr]
    assert int(stored.token_mask.sum()) == BLOCK_SIZE
    assert torch.equal(cache.hot.keys[:, pages[0]], stored.keys.to(cache.hot.keys.dtype))  # kept, in order

    start = first * BLOCK_SIZE
    metadata = AttentionMetadata.for_rows(
        [RowInput(table, seq.num_tokens - 1, 1)], BLOCK_SIZE, cache.blocks_per_group, torch.device("cpu")
    )
    for layer in range(engine.config.num_layers):
        context = dense_context(cache, layer, metadata)
        visible = context.visible[0, 0, 0]  # [L]
        assert bool(visible[start : start + BLOCK_SIZE].all())  # the kept tokens
        assert not bool(visible[start + BLOCK_SIZE : start + 2 * BLOCK_SIZE].any())  # no slot is dropped-to
        query = torch.randn(engine.config.num_heads, engine.config.head_dim)
        weights = attention_weights(query, context.keys[0], visible)  # [H, L]
        assert float(weights[:, start + BLOCK_SIZE : start + 2 * BLOCK_SIZE].abs().sum()) == 0.0
        assert float(weights[:, start : start + BLOCK_SIZE].sum()) > 0.0
    while not collector.done.is_set():
        engine.step()
    assert collector.result().error is None
    engine.stop()


def pruning_config(kvstore: KVStoreProcess) -> ColdTierConfig:
    """Pruning on, a 32-token window that the first scoring fills, and no rescoring after it."""
    return ColdTierConfig(
        target=kvstore.target, score_every_steps=1000, aux_window_tokens=32, prune_tokens=True, codec=HALF,
        **HEALTHY,
    )  # fmt: skip


def attention_weights(query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax weights of one query `[H, D]` over keys `[KVH, L, D]` where `visible` `[L]` (GQA)."""
    groups = query.shape[0] // keys.shape[0]
    scores = query.unsqueeze(1) @ keys.float().repeat_interleave(groups, 0).transpose(-1, -2)  # [H, 1, L]
    scores = scores[:, 0] / query.shape[-1] ** 0.5
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def test_prompt_blocks_stay_whole_while_demoted_blocks_are_pruned(
    stories_hf_dir: Path, kvstore: KVStoreProcess
) -> None:
    """A reused prefix from a store where pruning is on gives the output of computing it."""
    first = load_engine(stories_hf_dir, pruning_config(kvstore), PAGED_TIERS)
    assert first.cold is not None
    prompt = long_prompt(first)
    collector = ResultCollector(prompt)
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    first.submit(prompt, params, collector, retrieval_mode="semantic")
    step_until_a_window_loads(first, collector)
    (seq,) = first.scheduler.running
    assert all(len(pages) == 1 for pages in seq.block_table.aux_blocks.values())  # demoted: pruned
    while not collector.done.is_set():
        first.step()
    first.cold.tier.flush()
    first.step()
    num_blocks = (len(prompt) - 1) // BLOCK_SIZE
    names = [BlockHash(h.hex()) for h in prompt_block_hashes(first, prompt)[:num_blocks]]
    with kvstore.client(DEFAULT_TENANT, first.model_id) as client:
        served = client.get(names)
    for name in names:
        block = served[name]
        assert not isinstance(block, MissReason)
        assert block.codec is Codec.RAW and block.shape[2] == BLOCK_SIZE  # every token, BF16

    plain = load_engine(stories_hf_dir, ColdTierConfig())  # no cold tier: the prompt is computed
    computed = run(plain, prompt).result()
    plain.stop()
    second = load_engine(stories_hf_dir, pruning_config(kvstore))
    reused = run(second, prompt).result()
    assert second.stats().cold.prompt_tokens_loaded == num_blocks * BLOCK_SIZE  # type: ignore[union-attr]
    assert reused.token_ids == computed.token_ids
    first.stop()
    second.stop()
