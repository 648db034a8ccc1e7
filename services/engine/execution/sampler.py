"""Next-token choice for a whole batch at once: greedy argmax, or temperature + top-k + top-p sampling.

Sampled rows are drawn together, in a fixed number of batched tensor operations whatever the batch
size. (Drawing row by row cost about ten kernel launches per row, thousands per step at batch 256.)

Each draw inverts the cumulative distribution at one uniform number per row. That number is
counter-based: a hash (the splitmix64 finalizer, in int64 tensor arithmetic that wraps) of the
request's seed and the index of the token being drawn. So a seeded request gives the same tokens
whatever its batch neighbours are, and after a preemption that recomputes it, and no generator
state lives on the device.

A row's draw depends on nothing but its own logits, settings and key. A row that filters (top-k or
top-p) ranks its tokens by logit, ties by id, and inverts in rank order; one that does not inverts
in id order and never sorts, whatever its neighbours do. Weights are fixed-point integers, so the
cumulative sums are exact and no float reduction's order (which follows the batch's shape) can move
a draw.

The same draw also runs as Triton kernels (`sample_fused`, sampler_kernel.py): one settings copy and
one program per row, plus a scaling launch and `torch.topk`/`torch.sort` when some row filters, in
place of about 35 small launches. `sample_reference`, the torch code, is the CPU path and the
kernels' oracle. The kernels repeat its arithmetic operation for operation, with libdevice's `expf`
for `exp` (what PyTorch's CUDA `exp` calls), so on a GPU both should give the same weights and tokens
(test_sampler_kernel checks that premise there; on an H100 no row of 32 shapes differed from the
reference). Where an `exp` differs by an ulp (the CPU interpreter's numpy against PyTorch's CPU
`exp`), a draw can differ only where its uniform lies within that ulp's weight of a boundary
between two tokens. `sample` takes the kernels on CUDA (KERNELS_ON_CUDA): 0.13-0.53 ms a step at
batch 1 on an H100 against 0.79-2.27 ms for the torch code
(bench/results/sampler_speed_2026-12-07_kernel.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.engine.execution import sampler_kernel
from services.engine.execution.sampler_kernel import BY_ID, GREEDY
from services.engine.scheduling.sampling_params import SamplingParams

FAULT = -1  # the token id of a row whose logits or probabilities are not finite
KERNELS_ON_CUDA = True  # False: the torch reference on CUDA too


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
    if KERNELS_ON_CUDA and logits.device.type == "cuda" and not all(p.is_greedy for p in params):
        return sample_fused(logits, params, draw_keys)
    return sample_reference(logits, params, draw_keys)


def sample_fused(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    draw_keys: Sequence[tuple[int, int]],
    block: int | None = None,
) -> torch.Tensor:
    """`sample` through the Triton kernels (the CUDA path); `block` logits per step (tests: small)."""
    logits = logits.float() if logits.stride(-1) == 1 else logits.float().contiguous()
    vocab = logits.shape[-1]
    settings = _to_device(_settings(params, draw_keys, vocab), logits.device)  # [B, 6]
    ranked_rows = [r for r, p in enumerate(params) if not p.is_greedy and _filters(p, vocab)]
    ranked = order = None
    if ranked_rows:
        scaled = sampler_kernel.scale_ranked_rows(logits, settings, len(ranked_rows), block)  # [R, V]
        ranked, order = _rank(scaled, max(_top_k(params[r], vocab) for r in ranked_rows))
    return sampler_kernel.draw(logits, settings, ranked, order, _scale_bits(vocab), block)


def _settings(
    params: Sequence[SamplingParams], draw_keys: Sequence[tuple[int, int]], vocab: int
) -> torch.Tensor:
    """`[B, 6]` int64 on the host, per row: slot (GREEDY, BY_ID or its rank among the rows that
    filter), top-k, seed, draw index, and temperature and top-p as float64 bits."""
    ints, floats = [], []
    num_ranked = 0
    for p, (seed, index) in zip(params, draw_keys, strict=True):
        slot = GREEDY if p.is_greedy else num_ranked if _filters(p, vocab) else BY_ID
        num_ranked += slot >= 0
        ints.append((slot, _top_k(p, vocab), seed, index))
        floats.append((1.0 if p.is_greedy else p.temperature, p.top_p))  # greedy: argmax of the logits
    as_bits = torch.tensor(floats, dtype=torch.float64).view(torch.int64)  # [B, 2]
    return torch.cat([torch.tensor(ints, dtype=torch.int64), as_bits], dim=1)


def sample_reference(
    logits: torch.Tensor, params: Sequence[SamplingParams], draw_keys: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """`sample` in plain torch ops: the CPU path, and the oracle the kernels are tested against."""
    token_ids = logits.argmax(dim=-1)  # [B] greedy for everyone, overwritten for sampled rows
    token_ids.masked_fill_(~torch.isfinite(logits).all(dim=-1), FAULT)
    vocab = logits.shape[-1]
    sampled = [r for r, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return token_ids
    by_id = [r for r in sampled if not _filters(params[r], vocab)]
    by_rank = [r for r in sampled if _filters(params[r], vocab)]
    rows = _rows_on_device(by_id + by_rank, params, draw_keys, vocab, logits.device)
    scaled = logits.index_select(0, rows.batch_rows) / rows.temperature[:, None]  # [R, V]
    u = uniform(rows.seeds, rows.draws)  # [R]
    scale_bits = _scale_bits(vocab)
    split = len(by_id)
    drawn = [] if not by_id else [_draw_by_id(scaled[:split], u[:split], scale_bits)]
    if by_rank:
        largest_k = max(_top_k(params[r], vocab) for r in by_rank)
        filters = rows.top_k[split:], rows.top_p[split:]
        drawn.append(_draw_by_rank(scaled[split:], *filters, u[split:], largest_k, scale_bits))
    ok = torch.isfinite(scaled).all(dim=-1)
    token_ids.index_copy_(0, rows.batch_rows, torch.where(ok, torch.cat(drawn), FAULT))
    return token_ids


class _Rows(NamedTuple):
    """The sampled rows' settings on the device, each `[R]`."""

    batch_rows: torch.Tensor  # int64: the row in the batch
    top_k: torch.Tensor  # int64: the vocabulary size when top-k is off
    seeds: torch.Tensor  # int64
    draws: torch.Tensor  # int64: the index of the token being drawn
    temperature: torch.Tensor  # fp32
    top_p: torch.Tensor  # fp32


def _top_k(params: SamplingParams, vocab: int) -> int:
    return params.top_k if 0 < params.top_k < vocab else vocab


def _filters(params: SamplingParams, vocab: int) -> bool:
    """True when the row keeps only some tokens (top-k or top-p), so it must rank them by logit."""
    return _top_k(params, vocab) < vocab or params.top_p < 1.0


def _rows_on_device(
    rows: list[int],
    params: Sequence[SamplingParams],
    draw_keys: Sequence[tuple[int, int]],
    vocab: int,
    device: torch.device,
) -> _Rows:
    """The rows' settings, in two host-to-device copies (one of ints, one of floats)."""
    ints = torch.tensor(
        [
            rows,
            [_top_k(params[r], vocab) for r in rows],
            [draw_keys[r][0] for r in rows],
            [draw_keys[r][1] for r in rows],
        ],
        dtype=torch.int64,
    )  # [4, R]
    floats = torch.tensor([[params[r].temperature for r in rows], [params[r].top_p for r in rows]])  # [2, R]
    return _Rows(*_to_device(ints, device), *_to_device(floats, device))


def _scale_bits(vocab: int) -> int:
    """Fixed-point bits of a weight such that `vocab` weights of at most 1 sum below 2^62."""
    return 62 - vocab.bit_length()


def _weights(scaled: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """`[R, W]` int64 exp(logit - the row's largest) in fixed point: the best token weighs 2^scale_bits.

    Integers make every cumulative sum exact, so a draw cannot depend on the order in which a
    reduction added its terms, which varies with the batch's shape (and on a GPU with the kernel's
    launch shape). The fp32 product is exact and the cast truncates, so a token whose weight is
    below 2^-scale_bits of the best one's (2^-45 at a 128K vocabulary) is never drawn.
    """
    best = scaled.amax(dim=-1, keepdim=True)  # [R, 1]
    return (scaled - best).exp_().mul_(float(1 << scale_bits)).long()


def _draw_by_id(scaled: torch.Tensor, u: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """`[R]` token ids drawn from each row's whole distribution, in id order: no sort."""
    cumulative = torch.cumsum(_weights(scaled, scale_bits), dim=-1)  # [R, V] int64, exact
    return _invert(cumulative, cumulative[:, -1:], u)


def _draw_by_rank(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    largest_k: int,
    scale_bits: int,
) -> torch.Tensor:
    """`[R]` token ids drawn from each row's top-k, then top-p, tokens (ranked by logit, ties by id).

    Top-p applies to the distribution renormalized over the top-k set; the most likely token always
    survives. Only the first `largest_k` ranks are computed; a row's draw never looks past its own
    k. Both filters keep a prefix of the ranks, so one cumulative sum serves both.
    """
    ranked, order = _rank(scaled, largest_k)
    weights = _weights(ranked, scale_bits)  # [R, W]
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    weights.masked_fill_(rank[None, :] >= top_k[:, None], 0)
    cumulative = torch.cumsum(weights, dim=-1)  # [R, W] int64, exact
    mass_before = cumulative - weights  # weight of strictly better tokens
    within_p = mass_before < top_p[:, None].double() * cumulative[:, -1:].double()
    num_kept = within_p.sum(dim=-1, keepdim=True).clamp_(min=1)  # [R, 1]; rank 0 always survives
    kept = torch.where(top_p[:, None] >= 1.0, cumulative[:, -1:], cumulative.gather(1, num_kept - 1))
    drawn = _invert(cumulative, kept, u)  # [R] ranks
    if order is None:
        return _id_at_rank(scaled, ranked, drawn)
    return order.gather(1, drawn[:, None]).squeeze(1)


def _rank(scaled: torch.Tensor, largest_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[R, W]` each row's scaled logits best first, and `[R, V]` their ids when the rows are sorted.

    With every row keeping a top-k (W = the largest k), `topk` ranks only that far and its ids are not
    used (see `_id_at_rank`); otherwise a stable sort ranks the whole row, ties by id.
    """
    if largest_k < scaled.shape[-1]:  # every row keeps a top-k: no full sort
        return torch.topk(scaled, largest_k, dim=-1).values, None
    ranked, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    return ranked, order


def _id_at_rank(scaled: torch.Tensor, ranked: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """`[R]` the id of the token at `rank` of each row, tied logits ranked by id, as the stable sort
    ranks them: `topk` orders (and picks) tied logits its own way, so only its values are used.

    The token is the j-th lowest id among those whose logit equals the rank's, where j counts the
    tied ranks before it: whether a row is ranked by `topk` or by `sort` depends on its neighbours,
    and the token it draws must not.
    """
    value = ranked.gather(1, rank[:, None])  # [R, 1]
    num_better = (ranked > value).sum(dim=-1, keepdim=True)  # [R, 1]: every better token is ranked
    tied_so_far = torch.cumsum(scaled == value, dim=-1, dtype=torch.int32)  # [R, V]
    token_ids = (tied_so_far <= rank[:, None] - num_better).sum(dim=-1)  # [R]
    return token_ids.clamp_(max=scaled.shape[-1] - 1)  # a row with bad numbers (the caller faults it)


def _invert(cumulative: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`[R]` index where each row's cumulative int64 weight first exceeds `u` of `total` `[R, 1]`.

    The target is an integer below `total`, a value `cumulative` reaches, so the chosen index has a
    weight above zero and lies at or before it. A row with bad numbers gets some index in range
    (the caller faults it).
    """
    target = torch.minimum((u[:, None] * total.double()).long(), total - 1)  # [R, 1]
    index = torch.searchsorted(cumulative, target, right=True)  # [R, 1]
    return index.clamp_(0, cumulative.shape[-1] - 1).squeeze(1)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (pinned, non-blocking)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
