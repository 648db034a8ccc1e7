"""The draw of a row that filters by top-p alone, without sorting its vocabulary: `draw_top_p`.

`sampler.sample_reference` ranks such a row with a stable sort of its whole vocabulary (scaled logit
descending, ties by id), keeps the ranks up to the first whose cumulative weight reaches top-p of
the total, and inverts there. Only a prefix of the ranks is ever looked at, and a prefix in rank
order is the set of tokens whose scaled logit is at least some value. So the program works in the
space of sort keys (`_key`, an order-preserving int32 image of the fp32 scaled logit), where
C(k), the weight of the tokens whose key is at least k, is the cumulative weight at the end of that
prefix:

1. One pass weighs NUM_CUTS prefixes at once (`_masses`): the tokens within 1/32, 1/8, ..., ~30
   (quadratic steps) of the row's best scaled logit, and the whole row, which gives the total.
2. The last kept rank is the first whose cumulative weight reaches the top-p threshold, so the
   smallest weighed prefix that reaches it holds every kept rank. While that prefix has more than
   CAP (`max_candidates`) tokens, one more pass weighs NUM_CUTS keys spread evenly between its key
   and the next weighed key above (`_narrow_passes`), until it has at most CAP tokens or the two keys
   are adjacent.
3. Fast path: the prefix's sort keys (key, then the complement of the id, so that a descending sort
   ranks ties by id) go to the row's scratch, are sorted in the program (`tl.sort` over CAP), and the
   reference's kept / target / search runs over that sorted block (`_draw_sorted`). Passes over the
   row: the max (sampler_kernel), one weighing, one narrowing per pass above, one compaction.
4. Slow path (a flat row: more than CAP tokens score at least the last kept rank): no sort. Tokens
   with one key tie and weigh the same, so C(v + 1) and the tie count at the crossing key v place
   the last kept rank by arithmetic (`_last_kept_mass`); the drawn rank's key is narrowed the same
   way, and one more pass finds the tied token's id (`_draw_unsorted`). Each narrowing pass shrinks
   an interval of at most 2^32 keys 32-fold, so at most 17 passes over the row in all.

Every choice is made in the program from exact int64 sums, so nothing waits on the host, and the
weights are `fixed_point_weights`, the reference's arithmetic (and sampler_kernel's): the kept set,
target and token are the reference's whichever path a row takes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

NUM_CUTS = 32  # prefixes weighed per pass over the row
MAX_CANDIDATES = 4096  # most tokens a row sorts in its program (a power of two)
MAX_CUT_BLOCK = 512  # logits per step of a weighing pass: [NUM_CUTS, 512] comparisons at once

_NUM_CUTS = tl.constexpr(NUM_CUTS)
_INT32_MIN = tl.constexpr(-(1 << 31))  # a key below every float's, so the cut that holds the whole row
_INT64_MAX = tl.constexpr((1 << 63) - 1)
_INT64_MIN = tl.constexpr(-(1 << 63))  # a sort key below every token's: the padding of the sort
_LOW_32 = tl.constexpr((1 << 32) - 1)


@triton.jit
def fixed_point_weights(scaled, best, SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """int64 exp(scaled - best) * SCALE, truncated: sampler._weights, operation for operation."""
    shifted = scaled - best
    exp = libdevice.exp(shifted) if LIBDEVICE else tl.exp(shifted)  # interpreter: numpy's exp
    return (exp * SCALE).to(tl.int64)


@triton.jit
def _key(scaled):
    """int64 in [-2^31, 2^31): orders as the fp32 `scaled` do, -0.0 and 0.0 alike (they tie)."""
    bits = tl.where(scaled == 0.0, 0.0, scaled).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _scaled_of(key):
    """The fp32 whose `_key` is `key`."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_block(row_ptr, start, vocab, temperature, BLOCK: tl.constexpr):
    """`[BLOCK]` ids start.. and their scaled logits (-inf past the vocabulary)."""
    offs = start + tl.arange(0, BLOCK)
    logits = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
    return offs, tl.div_rn(logits, temperature)


@triton.jit
def _masses(
    row_ptr, vocab, temperature, best, cuts, SCALE: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr
):
    """`[NUM_CUTS]` int64 each: C(cut), the weight of the tokens whose key is at least each cut, and
    their number."""
    mass = tl.zeros([_NUM_CUTS], tl.int64)
    count = tl.zeros([_NUM_CUTS], tl.int64)
    for start in range(0, vocab, BLOCK):
        offs, scaled = _scaled_block(row_ptr, start, vocab, temperature, BLOCK)
        weights = fixed_point_weights(scaled, best, SCALE, LIBDEVICE)  # [BLOCK]
        is_above = (_key(scaled)[None, :] >= cuts[:, None]) & (offs < vocab)[None, :]  # [NUM_CUTS, BLOCK]
        mass += tl.sum(tl.where(is_above, weights[None, :], 0), axis=1)
        count += tl.sum(is_above.to(tl.int64), axis=1)
    return mass, count


@triton.jit
def _reaches(mass, bound, IS_THRESHOLD: tl.constexpr):
    """Whether a cumulative weight reaches `bound`: the float64 top-p threshold (the rank where it first
    does is the last kept), or past the int64 target (the rank where it first does is drawn)."""
    return mass.to(tl.float64) >= bound if IS_THRESHOLD else mass > bound


@triton.jit
def _narrow(
    cuts, mass, count, bound, IS_THRESHOLD: tl.constexpr, lo, mass_lo, count_lo, hi, mass_hi, count_hi
):
    """The interval [lo, hi) of keys that holds the crossing key (C(lo) reaches `bound`, C(hi) does
    not), narrowed to the weighed cuts either side of it, with C and the count at both ends.

    C and the count only shrink as the key grows, so the largest cut that reaches has the smallest
    mass and count of those that reach, and the smallest that does not the largest of those."""
    is_reached = _reaches(mass, bound, IS_THRESHOLD)
    is_lo = is_reached & (cuts > lo)
    is_hi = ~is_reached & (cuts < hi)
    new_lo = tl.max(tl.where(is_lo, cuts, lo))
    new_hi = tl.min(tl.where(is_hi, cuts, hi))
    mass_lo = tl.min(tl.where(is_lo, mass, mass_lo))
    count_lo = tl.min(tl.where(is_lo, count, count_lo))
    mass_hi = tl.max(tl.where(is_hi, mass, mass_hi))
    count_hi = tl.max(tl.where(is_hi, count, count_hi))
    return new_lo, mass_lo, count_lo, new_hi, mass_hi, count_hi


@triton.jit
def _narrow_passes(
    row_ptr,
    vocab,
    temperature,
    best,
    bound,
    IS_THRESHOLD: tl.constexpr,
    lo,
    mass_lo,
    count_lo,
    hi,
    mass_hi,
    count_hi,
    max_count,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`_narrow` over NUM_CUTS keys spread evenly over [lo, hi), one pass each, until at most
    `max_count` tokens have a key of at least lo or the interval is one key wide."""
    steps = tl.arange(0, _NUM_CUTS).to(tl.int64)
    while (count_lo > max_count) & (hi - lo > 1):
        cuts = lo + (hi - lo) * steps // _NUM_CUTS  # [NUM_CUTS] from lo, at most ceil(width / 32) apart
        mass, count = _masses(row_ptr, vocab, temperature, best, cuts, SCALE, LIBDEVICE, BLOCK)
        lo, mass_lo, count_lo, hi, mass_hi, count_hi = _narrow(
            cuts, mass, count, bound, IS_THRESHOLD, lo, mass_lo, count_lo, hi, mass_hi, count_hi
        )
    return lo, mass_lo, count_lo, hi, mass_hi, count_hi


@triton.jit
def _sort_keys(scaled, offs):
    """int64 keys that sort descending in rank order: `_key` above, and the complement of the id below,
    so that tied logits rank by ascending id."""
    return (_key(scaled) << 32) | (tl.full((), _LOW_32, tl.int64) - offs.to(tl.int64))


@triton.jit
def _compact(row_ptr, vocab, temperature, lo, scratch_ptr, BLOCK: tl.constexpr):
    """Write the sort keys of the tokens whose key is at least `lo` to `scratch_ptr`, in id order."""
    carry = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs, scaled = _scaled_block(row_ptr, start, vocab, temperature, BLOCK)
        is_candidate = (_key(scaled) >= lo) & (offs < vocab)
        slots = carry + tl.cumsum(is_candidate.to(tl.int64), 0) - 1
        tl.store(scratch_ptr + slots, _sort_keys(scaled, offs), mask=is_candidate)
        carry += tl.sum(is_candidate.to(tl.int64))


@triton.jit
def _draw_sorted(
    scratch_ptr, count, best, threshold, u, SCALE: tl.constexpr, LIBDEVICE: tl.constexpr, CAP: tl.constexpr
):
    """The id drawn at `u` from the `count` candidates' sort keys in `scratch_ptr`: sampler._draw_by_rank
    over the candidates ranked (they hold every kept rank)."""
    rank = tl.arange(0, CAP)
    is_candidate = rank < count
    keys = tl.sort(tl.load(scratch_ptr + rank, mask=is_candidate, other=_INT64_MIN), descending=True)
    scaled = tl.where(is_candidate, _scaled_of(keys >> 32), float("-inf"))  # [CAP] best first
    weights = fixed_point_weights(scaled, best, SCALE, LIBDEVICE)
    cumulative = tl.cumsum(weights, 0)  # [CAP] int64, exact
    is_kept = ((cumulative - weights).to(tl.float64) < threshold) & is_candidate
    kept = tl.max(tl.where(is_kept, cumulative, 0))
    target = tl.minimum((u * kept.to(tl.float64)).to(tl.int64), kept - 1)
    drawn = tl.sum(((cumulative <= target) & is_candidate).to(tl.int32))
    low_32 = tl.full((), _LOW_32, tl.int64)
    return low_32 - tl.sum(tl.where(rank == drawn, keys & low_32, 0))


@triton.jit
def _tied_weight(mass_lo, count_lo, mass_hi, count_hi):
    """The weight of each token whose key is lo, when hi = lo + 1: tied tokens weigh the same.

    Both differences are positive when the interval holds the crossing; the floors of 1 only keep a
    broken invariant from dividing by zero."""
    return tl.maximum((mass_lo - mass_hi) // tl.maximum(count_lo - count_hi, 1), 1)


@triton.jit
def _last_kept_mass(mass_above, count_tied, weight, threshold):
    """C through the last kept rank, when it lies among `count_tied` tokens of equal `weight` that follow
    ranks of weight `mass_above`: the first of them whose cumulative weight reaches `threshold`."""
    lo = tl.full((), 0, tl.int64)
    hi = count_tied - 1  # the whole tie reaches it
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if _reaches(mass_above + (mid + 1) * weight, threshold, True):
            hi = mid
        else:
            lo = mid + 1
    return mass_above + (lo + 1) * weight


@triton.jit
def _tied_id(row_ptr, vocab, temperature, key, nth, BLOCK: tl.constexpr):
    """The `nth` lowest id (from 0) among the tokens whose key is `key`."""
    start = tl.full((), 0, tl.int32)
    carry = tl.full((), 0, tl.int64)
    offs, scaled = _scaled_block(row_ptr, start, vocab, temperature, BLOCK)
    tied = ((_key(scaled) == key) & (offs < vocab)).to(tl.int64)
    while (start + BLOCK < vocab) & (carry + tl.sum(tied) <= nth):
        carry += tl.sum(tied)
        start += BLOCK
        offs, scaled = _scaled_block(row_ptr, start, vocab, temperature, BLOCK)
        tied = ((_key(scaled) == key) & (offs < vocab)).to(tl.int64)
    is_before = ((carry + tl.cumsum(tied, 0)) <= nth) & (offs < vocab)
    return tl.minimum(start + tl.sum(is_before.to(tl.int64)), vocab - 1)


@triton.jit
def _draw_unsorted(
    row_ptr,
    vocab,
    temperature,
    best,
    threshold,
    u,
    key,
    mass_lo,
    count_lo,
    mass_hi,
    count_hi,
    cuts,
    mass,
    count,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
    CUT_BLOCK: tl.constexpr,
):
    """The id drawn at `u` when the last kept rank has key `key` (C(key) = mass_lo, C(key + 1) =
    mass_hi): no sort, only passes that weigh keys. `cuts`, `mass` and `count` are the first pass's,
    which narrow the target's key too."""
    weight = _tied_weight(mass_lo, count_lo, mass_hi, count_hi)
    kept = _last_kept_mass(mass_hi, count_lo - count_hi, weight, threshold)
    target = tl.minimum((u * kept.to(tl.float64)).to(tl.int64), kept - 1)
    zero = tl.full((), 0, tl.int64)
    key, mass_lo, count_lo, hi, mass_hi, count_hi = _narrow(
        cuts, mass, count, target, False, key, mass_lo, count_lo, _key(best) + 1, zero, zero
    )
    key, mass_lo, count_lo, _, mass_hi, count_hi = _narrow_passes(
        row_ptr, vocab, temperature, best, target, False,
        key, mass_lo, count_lo, hi, mass_hi, count_hi,
        zero, SCALE, LIBDEVICE, CUT_BLOCK,
    )  # fmt: skip
    weight = _tied_weight(mass_lo, count_lo, mass_hi, count_hi)
    return _tied_id(row_ptr, vocab, temperature, key, (target - mass_hi) // weight, BLOCK)


@triton.jit
def draw_top_p(
    row_ptr,
    vocab,
    temperature,
    best,
    top_p,
    u,
    scratch_ptr,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
    CUT_BLOCK: tl.constexpr,
    CAP: tl.constexpr,
):
    """The id a top-p-only row draws at `u`: sampler._draw_by_rank's token, with no sort of the row.

    `scratch_ptr` has room for CAP int64 sort keys, the most candidates the row sorts."""
    steps = tl.arange(0, _NUM_CUTS)
    below_best = ((steps + 1) * (steps + 1)).to(tl.float32) * 0.03125  # 1/32 .. 30
    cuts = tl.where(steps < _NUM_CUTS - 1, _key(best - below_best), _INT32_MIN)  # the last: the whole row
    mass, count = _masses(row_ptr, vocab, temperature, best, cuts, SCALE, LIBDEVICE, CUT_BLOCK)
    total = tl.max(mass)
    threshold = tl.maximum(top_p.to(tl.float64) * total.to(tl.float64), 1.0)  # 1: rank 0 is always kept
    largest = tl.full((), _INT64_MAX, tl.int64)
    zero = tl.full((), 0, tl.int64)
    lo, mass_lo, count_lo, hi, mass_hi, count_hi = _narrow(
        cuts, mass, count, threshold, True, _INT32_MIN - 1, largest, largest, _key(best) + 1, zero, zero
    )
    lo, mass_lo, count_lo, _, mass_hi, count_hi = _narrow_passes(
        row_ptr, vocab, temperature, best, threshold, True,
        lo, mass_lo, count_lo, hi, mass_hi, count_hi,
        CAP, SCALE, LIBDEVICE, CUT_BLOCK,
    )  # fmt: skip
    if count_lo <= CAP:  # fast path
        _compact(row_ptr, vocab, temperature, lo, scratch_ptr, BLOCK)
        tl.debug_barrier()  # the program's other threads wrote some of the keys
        token = _draw_sorted(scratch_ptr, count_lo, best, threshold, u, SCALE, LIBDEVICE, CAP)
    else:  # slow path: hi == lo + 1
        token = _draw_unsorted(
            row_ptr, vocab, temperature, best, threshold, u,
            lo, mass_lo, count_lo, mass_hi, count_hi, cuts, mass, count,
            SCALE, LIBDEVICE, BLOCK, CUT_BLOCK,
        )  # fmt: skip
    return token
