"""What comes back from the kvstore is checked against what the engine expects before it is used:
a window block of another shape, or one that decodes to a value that is not finite, is a miss
(a `corrupt` degradation), never mapped over pages that are not its own and never attended.

The store is not trusted for this: anyone who can reach it can put a block first under a name the
engine will use, and the engine's own put is then a duplicate (first write wins). The end-to-end
test does exactly that against a real kvstore process over a real redis-server.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from services.common.kv_codec.codec import (
    HEADER,
    KEEP_ALL,
    CodecError,
    CodecSettings,
    SparsityRule,
    SparsityTier,
    decode_block,
    encode_block,
    read_layout,
)
from services.common.kvstore_api import BlockHash, BlockIn, BlockSource, Codec, FetchedBlock, Namespace
from services.engine.kv.cold_tier import DEFAULT_TENANT, ColdTierConfig, WindowShape, _decode
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector
from tests.engine.kv.test_cold_tier import (
    HEALTHY,
    STORY,
    WINDOW_TIERS,
    degradations,
    degraded_events,
    kvstore,
    load_engine,
)
from tests.kvstore.conftest import KVStoreProcess

__all__ = ["kvstore"]

SHAPE = WindowShape(num_layers=2, num_tokens=32, num_kv_heads=2, head_dim=8)
KEEP_EVERY_TOKEN = CodecSettings(sparsity=KEEP_ALL)
FP16_NAN = b"\x00\x7e"


def block_keys(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def int2_block(shape: tuple[int, ...], settings: CodecSettings = KEEP_EVERY_TOKEN) -> FetchedBlock:
    """A served INT2-sparse block of keys and values `shape` `[L, T, KVH, D]`."""
    keys = block_keys(shape)
    payload = encode_block(keys, -keys, torch.ones(shape[1]), settings)
    return FetchedBlock(
        "h", Codec.INT2_SPARSE, tuple(read_layout(payload).dense_shape), payload, BlockSource.DISK
    )


def raw_block(shape: tuple[int, ...]) -> FetchedBlock:
    """A served raw (BF16) block; `shape` as the store declares it."""
    payload = torch.zeros(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    return FetchedBlock("h", Codec.RAW, shape, payload, BlockSource.DISK)


def with_nan_key_scale(payload: bytes) -> bytes:
    """The payload with its first key scale set to NaN (a flipped or hostile byte that decodes)."""
    layout = read_layout(payload)
    offset = HEADER.size + layout.mask_bytes + layout.code_bytes
    return payload[:offset] + FP16_NAN + payload[offset + 2 :]


# --- _decode against the expected shape ------------------------------------------------------------


def test_a_window_block_of_the_expected_shape_decodes() -> None:
    decoded = _decode(int2_block(tuple(SHAPE)), page_tokens=16, expected=SHAPE)
    assert decoded is not None and decoded[0].shape == tuple(SHAPE)
    raw = _decode(raw_block((2, 2, 32, 2, 8)), page_tokens=16, expected=SHAPE)
    assert raw is not None and raw[0].shape == tuple(SHAPE)


@pytest.mark.parametrize(
    "shape",
    [(3, 32, 2, 8), (2, 64, 2, 8), (2, 16, 2, 8), (2, 32, 1, 8), (2, 32, 2, 16)],
    ids=["layers", "twice-the-tokens", "half-the-tokens", "kv-heads", "head-dim"],
)
def test_a_window_block_of_another_shape_is_a_miss(shape: tuple[int, ...]) -> None:
    assert _decode(int2_block(shape), page_tokens=16) is not None  # a well-formed block...
    assert _decode(int2_block(shape), page_tokens=16, expected=SHAPE) is None  # ...not the engine's
    raw_shape = (shape[0], 2, *shape[1:])
    assert _decode(raw_block(raw_shape), page_tokens=16, expected=SHAPE) is None


@pytest.mark.parametrize("shape", [(2, 32, 2, 8), (2, 1, 32, 2, 8), (2, 3, 32, 2, 8), (2, 2, 32, 2, 8, 1)])
def test_a_raw_block_that_is_not_keys_and_values_is_a_miss_not_an_error(shape: tuple[int, ...]) -> None:
    assert _decode(raw_block(shape), page_tokens=16) is None


def test_a_window_block_that_decodes_to_nan_is_a_miss() -> None:
    block = int2_block(tuple(SHAPE))
    poisoned = FetchedBlock("h", block.codec, block.shape, with_nan_key_scale(block.payload), block.source)
    assert not bool(torch.isfinite(decode_block(poisoned.payload).keys).all())  # the codec takes it
    assert _decode(poisoned, page_tokens=16, expected=SHAPE) is None
    nan_raw = raw_block((2, 2, 32, 2, 8))
    payload = (
        torch.full((2, 2, 32, 2, 8), float("nan"), dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    )
    assert _decode(FetchedBlock("h", Codec.RAW, nan_raw.shape, payload, BlockSource.DISK), 16, SHAPE) is None


# --- the INT2 token mask ------------------------------------------------------------------------


def test_a_token_mask_bit_past_the_blocks_tokens_is_refused() -> None:
    keys = block_keys((1, 12, 1, 8))  # 12 tokens: the mask's second byte has 4 bits to spare
    payload = bytearray(encode_block(keys, keys, torch.ones(12), KEEP_EVERY_TOKEN))
    decode_block(bytes(payload))
    payload[HEADER.size + 1] |= 0x80  # bit 15: no token of the block
    with pytest.raises(CodecError, match="past the block"):
        decode_block(bytes(payload))
    assert (
        _decode(FetchedBlock("h", Codec.INT2_SPARSE, (1, 2, 12, 1, 8), bytes(payload), BlockSource.DISK), 4)
        is None
    )


def test_a_keep_all_block_that_drops_tokens_is_refused() -> None:
    keys = block_keys((1, 32, 1, 8))
    mass = torch.linspace(1.0, 2.0, 32)
    pruned = bytearray(encode_block(keys, keys, mass, CodecSettings(sparsity=SparsityRule(0.0, 1.0, 0.5))))
    assert read_layout(bytes(pruned)).tier is SparsityTier.TOP_K and read_layout(bytes(pruned)).num_kept == 16
    pruned[6] = SparsityTier.KEEP_ALL  # the header's sparsity tier (magic, version, scale dtype, tier)
    with pytest.raises(CodecError, match="keep-all"):
        decode_block(bytes(pruned))


# --- end to end: a poisoned store ---------------------------------------------------------------


@pytest.mark.parametrize("poison", ["twice-the-group", "not-finite"])
def test_poisoned_window_blocks_are_never_attended_and_the_request_completes(
    stories_hf_dir: Path, kvstore: KVStoreProcess, poison: str
) -> None:
    """Before the request runs, every name its demoted groups will take holds a block of the
    store's choosing: twice a group's tokens (mapped, it would take the next group's pages), or
    the right shape with a NaN scale. The engine's puts are duplicates; every window load is a
    miss; the request completes on hot + warm."""
    cold = ColdTierConfig(target=kvstore.target, score_every_steps=4, aux_window_tokens=32, **HEALTHY)
    engine = load_engine(stories_hf_dir, cold, WINDOW_TIERS)
    assert engine.cold is not None
    num_layers, _, _, num_kv_heads, head_dim = engine.runner.kv_cache.hot.keys.shape
    group = WINDOW_TIERS.group_size
    prompt = engine.tokenizer.encode(STORY)
    params = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    collector = ResultCollector(prompt)
    handle = engine.submit(prompt, params, collector, retrieval_mode="semantic")
    num_tokens = 2 * group if poison == "twice-the-group" else group
    payload = encode_block(
        *[block_keys((num_layers, num_tokens, num_kv_heads, head_dim))] * 2, torch.ones(num_tokens)
    )
    if poison == "not-finite":
        payload = with_nan_key_scale(payload)
    shape = tuple(read_layout(payload).dense_shape)
    names = [hashlib.sha256(f"{handle.request_id}:{first}".encode()).hexdigest() for first in range(32)]
    with kvstore.client(DEFAULT_TENANT, engine.model_id) as client:
        assert client.namespace == Namespace(DEFAULT_TENANT, engine.model_id)
        client.put([BlockIn(BlockHash(name), Codec.INT2_SPARSE, shape, payload) for name in names])
    before = degradations("load_window", "corrupt")

    while not collector.done.is_set():
        engine.step()
        engine.cold.tier.flush()

    result = collector.result()
    assert result.error is None and len(result.token_ids) == params.max_new_tokens
    assert engine.cold.stats.blocks_demoted > 0  # its puts were taken as duplicates of the poison
    assert engine.cold.stats.window_loads == 0  # no poisoned block was ever mapped
    assert degradations("load_window", "corrupt") > before
    reasons = {
        (e["thermocline.kv.operation"], e["thermocline.kv.reason"]) for e in degraded_events(collector)
    }
    assert reasons == {("load_window", "corrupt")}
    assert collector.final_event.usage.cold_tokens == 0  # type: ignore[union-attr]
    engine.stop()
