"""The INT2-sparse codec: vectorised equals reference, error bounds, sparsity rule, compression ratio."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.kv_codec.codec import (
    HEADER,
    KEEP_ALL,
    CodecError,
    CodecSettings,
    ScaleDtype,
    SparsityRule,
    SparsityTier,
    attention_entropy,
    bf16_bytes,
    choose_kept_tokens,
    decode_block,
    decode_block_reference,
    encode_block,
    encode_block_reference,
    read_layout,
)


def make_block(
    layers: int = 2, tokens: int = 16, heads: int = 2, dim: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random keys and values `[L, T, H, D]` with key outlier channels, and random attention mass."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, tokens, heads, dim, generator=generator)
    keys[..., 0] *= 8  # a fixed outlier channel, as real keys have
    values = torch.randn(layers, tokens, heads, dim, generator=generator)
    mass = torch.rand(tokens, generator=generator) ** 4
    return keys, values, mass


def concentrated_mass(tokens: int, hot: int) -> torch.Tensor:
    """Mass on `hot` tokens only: low entropy."""
    mass = torch.full((tokens,), 1e-4)
    mass[:hot] = 1.0
    return mass


def error_bound(x: torch.Tensor, decoded: torch.Tensor, group_range: torch.Tensor) -> None:
    """|x - x̂| <= range/6 (half a step of 3) plus fp16 rounding of the zero point and the scale."""
    slack = 2.0**-9 * (x.abs() + group_range)
    assert bool(((x - decoded).abs() <= group_range / 6 + slack).all())


@pytest.mark.parametrize(
    "settings",
    [
        CodecSettings(group_size=8, sparsity=KEEP_ALL),
        CodecSettings(group_size=32),
        CodecSettings(group_size=4, scale_dtype=ScaleDtype.BFLOAT16),
        CodecSettings(
            group_size=16, scale_dtype=ScaleDtype.FLOAT32, sparsity=SparsityRule(0.9, 0.99, 0.5, 0.2)
        ),
    ],
    ids=["g8-keep-all", "defaults", "g4-bf16", "g16-fp32-prune"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_encode_and_decode_equal_the_reference(settings: CodecSettings, seed: int) -> None:
    keys, values, mass = make_block(tokens=24, seed=seed)
    payload = encode_block(keys.bfloat16(), values.bfloat16(), mass, settings)
    assert payload == encode_block_reference(keys.bfloat16(), values.bfloat16(), mass, settings)
    fast, slow = decode_block(payload), decode_block_reference(payload)
    assert torch.equal(fast.token_mask, slow.token_mask)
    assert torch.equal(fast.keys, slow.keys) and torch.equal(fast.values, slow.values)


def test_round_trip_error_is_within_half_a_step() -> None:
    keys, values, mass = make_block(tokens=16)
    decoded = decode_block(encode_block(keys, values, mass, CodecSettings(group_size=8, sparsity=KEEP_ALL)))
    assert bool(decoded.token_mask.all())
    # keys: per channel over groups of 8 tokens
    grouped = keys.view(2, 2, 8, 2, 16)
    key_range = (
        (grouped.amax(2, keepdim=True) - grouped.amin(2, keepdim=True)).expand_as(grouped).reshape(keys.shape)
    )
    error_bound(keys, decoded.keys, key_range)
    # values: per token over groups of 8 channels
    grouped = values.view(2, 16, 2, 2, 8)
    value_range = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)).expand_as(grouped)
    error_bound(values, decoded.values, value_range.reshape(values.shape))


def test_per_channel_keys_beat_per_token_keys_on_outlier_channels() -> None:
    """Why keys are grouped per channel: a per-token group would spread the outlier's range."""
    keys, values, mass = make_block(tokens=32, dim=32)
    decoded = decode_block(encode_block(keys, values, mass, CodecSettings(group_size=32, sparsity=KEEP_ALL)))
    key_error = (keys - decoded.keys)[..., 1:].abs().mean()
    value_error = (values - decoded.values).abs().mean()  # per-token groups, no outliers
    assert key_error < 1.5 * value_error


def test_dense_view_puts_kept_tokens_back_in_place() -> None:
    keys, values, _ = make_block(tokens=16)
    mass = concentrated_mass(16, hot=3)
    mass[10] = 2.0  # the heaviest token is not at the front
    quarter = SparsityRule(low_entropy=0.6, high_entropy=0.9, low_keep_ratio=0.25)  # peaked: keeps 4 of 16
    decoded = decode_block(encode_block(keys, values, mass, CodecSettings(group_size=8, sparsity=quarter)))
    dense_keys, dense_values = decoded.to_dense()
    assert dense_keys.shape == keys.shape
    kept = decoded.token_mask
    assert bool(kept[10]) and bool(kept[:3].all()) and not bool(kept[3:10].any())
    assert bool((dense_keys[:, ~kept] == 0).all()) and bool((dense_values[:, ~kept] == 0).all())
    assert (dense_keys[:, kept] - keys[:, kept]).abs().max() < (keys.max() - keys.min()) / 6 + 0.1


def test_entropy_is_one_for_even_mass_and_zero_for_one_token() -> None:
    assert attention_entropy(torch.ones(16)) == pytest.approx(1.0)
    assert attention_entropy(torch.zeros(16)) == 1.0  # no evidence either way: treat as even
    one_hot = torch.zeros(16)
    one_hot[5] = 1.0
    assert attention_entropy(one_hot) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("mass", "tier", "num_kept"),
    [
        (torch.ones(16), SparsityTier.KEEP_ALL, 16),
        (concentrated_mass(16, hot=8), SparsityTier.TOP_K, 8),
        (concentrated_mass(16, hot=1), SparsityTier.PRUNE, 4),
    ],
    ids=["even", "mid", "peaked"],
)
def test_entropy_rule_sets_how_many_tokens_stay(
    mass: torch.Tensor, tier: SparsityTier, num_kept: int
) -> None:
    rule = SparsityRule(low_entropy=0.4, high_entropy=0.9, mid_keep_ratio=0.5, low_keep_ratio=0.25)
    mask, chosen = choose_kept_tokens(mass, rule)
    assert chosen == tier and int(mask.sum()) == num_kept
    kept_mass, dropped_mass = mass[mask], mass[~mask]
    assert dropped_mass.numel() == 0 or kept_mass.min() >= dropped_mass.max()


@pytest.mark.parametrize(
    ("mass", "num_kept_unpaged", "num_kept"),
    [
        (torch.ones(32), 32, 32),
        (concentrated_mass(32, hot=12), 16, 16),
        (concentrated_mass(32, hot=1), 8, 16),
    ],
    ids=["even", "mid", "peaked"],
)
def test_keep_multiple_rounds_the_kept_tokens_up_to_whole_pages(
    mass: torch.Tensor, num_kept_unpaged: int, num_kept: int
) -> None:
    """Pages of 16 tokens: the rule's 8 of 32 become 16 (the next most massive), 16 and 32 stay."""
    rule = SparsityRule(low_entropy=0.4, high_entropy=0.9, mid_keep_ratio=0.5, low_keep_ratio=0.25)
    paged = dataclasses.replace(rule, keep_multiple=16)
    assert int(choose_kept_tokens(mass, rule)[0].sum()) == num_kept_unpaged
    mask, _ = choose_kept_tokens(mass, paged)
    assert int(mask.sum()) == num_kept
    assert (~mask).sum() == 0 or mass[mask].min() >= mass[~mask].max()
    keys, values, _ = make_block(tokens=32)
    settings = CodecSettings(group_size=8, sparsity=paged)
    payload = encode_block(keys, values, mass, settings)
    assert payload == encode_block_reference(keys, values, mass, settings)
    assert read_layout(payload).num_kept == num_kept


def test_compression_against_bf16() -> None:
    """SmolLM2-135M's block shape (30 layers, 3 kv heads, head dim 64), 64 tokens, group 32."""
    keys, values, _ = make_block(layers=30, tokens=64, heads=3, dim=64)
    keep_all = encode_block(keys, values, torch.ones(64), CodecSettings(group_size=32, sparsity=KEEP_ALL))
    layout = read_layout(keep_all)
    # 2 bits a value, plus an fp16 scale and zero per 32 values: 2 / (0.25 + 0.125) = 5.33x
    assert bf16_bytes(layout) / len(keep_all) == pytest.approx(16 / 3, rel=0.01)
    half = SparsityRule(
        low_entropy=0.5, high_entropy=0.9, mid_keep_ratio=0.5
    )  # mass on 32 of 64: entropy 0.83
    halved = encode_block(
        keys, values, concentrated_mass(64, hot=32), CodecSettings(group_size=32, sparsity=half)
    )
    assert read_layout(halved).num_kept == 32
    assert bf16_bytes(layout) / len(halved) == pytest.approx(32 / 3, rel=0.01)


def test_malformed_payloads_are_codec_errors() -> None:
    keys, values, mass = make_block()
    payload = encode_block(keys, values, mass)
    with pytest.raises(CodecError, match="needs"):
        read_layout(payload[:-1])
    with pytest.raises(CodecError, match="magic"):
        read_layout(b"XXXX" + payload[4:])
    with pytest.raises(CodecError, match="shorter"):
        read_layout(payload[: HEADER.size - 1])
    flipped = bytearray(payload)
    flipped[HEADER.size] ^= 0xFF  # the token mask no longer agrees with the kept count
    with pytest.raises(CodecError, match="token mask keeps"):
        decode_block(bytes(flipped))


@pytest.mark.parametrize(
    ("keys", "mass", "message"),
    [
        (torch.zeros(2, 16, 2, 6), torch.ones(16), "multiple of 4"),
        (torch.zeros(16, 2, 16), torch.ones(16), "layers, tokens"),
        (torch.full((2, 16, 2, 16), float("nan")), torch.ones(16), "finite"),
        (torch.zeros(2, 16, 2, 16), -torch.ones(16), "non-negative"),
        (torch.zeros(2, 16, 2, 16), torch.ones(8), "one value per token"),
    ],
)
def test_unencodable_blocks_are_refused(keys: torch.Tensor, mass: torch.Tensor, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        encode_block(keys, keys.clone(), mass)


def test_rule_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        SparsityRule(low_entropy=0.9, high_entropy=0.5)
    with pytest.raises(ValueError, match="mid_keep_ratio"):
        SparsityRule(mid_keep_ratio=0.0)
    with pytest.raises(ValueError, match="keep_multiple"):
        SparsityRule(keep_multiple=0)
