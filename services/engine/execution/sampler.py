"""Next-token choice for a whole batch at once: greedy argmax, or temperature + top-k + top-p sampling.

Sampled rows are drawn together, in a fixed number of batched tensor operations whatever the batch
size. (Drawing row by row cost about ten kernel launches per row, thousands per step at batch 256.)

Each draw inverts the cumulative distribution at one uniform number per row. That number is
counter-based: a hash (the splitmix64 finalizer, in int64 tensor arithmetic that wraps) of the
request's seed and the index of the token being drawn. So a seeded request gives the same tokens
whatever its batch neighbours are, and after a preemption that recomputes it, and no generator
state lives on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.scheduling.sampling_params import SamplingParams

FAULT = -1  # the token id of a row whose logits or probabilities are not finite


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 (multiplication wraps modulo 2^64)."""
    x = x ^ _shift_right(x, 30)
    x = x * _MIX_1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX_2
    return x ^ _shift_right(x, 31)


def uniform(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """`[R]` float64 in (0, 1), 53 random bits each: row r's number for its `draws[r]`-th token."""
    bits = _shift_right(_mix(_mix(seeds) ^ (draws * _GOLDEN)), 11)  # [0, 2^53)
    return (bits.double() + 0.5) * 2.0**-53


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], draw_keys: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """Pick one token per row of fp32 `logits` `[B, V]`; returns `[B]` int64 on the logits' device.

    `draw_keys[r]` is row r's (seed, index of the token being drawn); greedy rows ignore theirs.
    A row whose numbers went bad (NaN or inf logits, or nothing left to draw from) gets FAULT
    instead of a token, so that the caller fails that row alone and the batch carries on. Nothing
    here synchronizes with the host.
    """
    token_ids = logits.argmax(dim=-1)  # [B] greedy for everyone, overwritten for sampled rows
    token_ids.masked_fill_(~torch.isfinite(logits).all(dim=-1), FAULT)
    rows = [r for r, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return token_ids
    vocab = logits.shape[-1]
    device = logits.device
    top_ks = [params[r].top_k if 0 < params[r].top_k < vocab else vocab for r in rows]  # vocab: off
    ints = _to_device(
        torch.tensor(
            [
                rows,
                top_ks,
                [draw_keys[r][0] for r in rows],
                [draw_keys[r][1] for r in rows],
            ],
            dtype=torch.int64,
        ),
        device,
    )  # [4, R]
    floats = _to_device(
        torch.tensor([[params[r].temperature for r in rows], [params[r].top_p for r in rows]]), device
    )  # [2, R] fp32
    index, top_k, seeds, draws = ints
    temperature, top_p = floats
    largest_k = max(top_ks)
    filtered = min(top_ks) < vocab or any(params[r].top_p < 1.0 for r in rows)
    scaled = logits.index_select(0, index) / temperature[:, None]  # [R, V]
    ok = torch.isfinite(scaled).all(dim=-1)
    if filtered:  # rank by logit; the draw picks a rank, mapped back to its token
        # when every row keeps a top-k, the ranks past the largest k never matter: no full sort
        if largest_k < vocab:
            scaled, order = torch.topk(scaled, largest_k, dim=-1)
        else:
            scaled, order = torch.sort(scaled, dim=-1, descending=True)
        probs = _filtered_probs(scaled, top_k, top_p)
    else:
        probs = torch.softmax(scaled, dim=-1)
    drawn = _invert(probs, uniform(seeds, draws))
    if filtered:
        drawn = order.gather(1, drawn[:, None]).squeeze(1)
    token_ids.index_copy_(0, index, torch.where(ok, drawn, FAULT))
    return token_ids


def _filtered_probs(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities over ranks (logits sorted, most likely first), zero outside top-k, then top-p.

    Top-p applies to the distribution renormalized over the top-k set; the most likely token always
    survives. The result is not renormalized: `_invert` scales by each row's total.
    """
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    probs = torch.softmax(ranked.masked_fill(rank[None, :] >= top_k[:, None], float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return probs.masked_fill(~keep, 0.0)


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`[R]` index where each row's cumulative probability first exceeds `u` of its total.

    A zero-probability index is never chosen: its cumulative value equals its predecessor's. Should
    rounding push the target past the last step of the sum, the row falls back to its most likely
    index.
    """
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [R, V]
    target = (u * cumulative[:, -1])[:, None]  # [R, 1]
    index = torch.searchsorted(cumulative, target, right=True).clamp_(max=probs.shape[-1] - 1)  # [R, 1]
    has_mass = probs.gather(1, index) > 0
    return torch.where(has_mass, index, probs.argmax(dim=-1, keepdim=True)).squeeze(1)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (pinned, non-blocking)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _draw_filtered(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """The race over each row's top-k, then top-p, tokens (ranked by logit, most likely first).

    Top-p applies to the distribution renormalized over the top-k set; the most likely token always
    survives. The noise is attached to ranks, which is as random as attaching it to token ids.
    """
    ranked, order = torch.sort(scaled, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    keep = rank[None, :] < top_k[:, None]
    ranked = ranked.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    choice = ranked.masked_fill(~keep, float("-inf")).add(noise).argmax(dim=-1, keepdim=True)  # [R, 1]
    return order.gather(1, choice).squeeze(1)
