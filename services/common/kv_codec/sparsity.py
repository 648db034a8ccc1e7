"""Token sparsity for cold blocks: the attention-entropy rule that decides how many tokens stay.

A block's tokens received some share of attention mass each. Normalised entropy of that
distribution near 1 means attention was spread evenly (no token is dispensable); near 0 means a
few tokens drew it all (the rest can go). `SparsityRule` maps entropy to a keep ratio, and
`choose_kept_tokens` keeps the tokens with the most mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.common.kv_codec.codec_format import CodecError, SparsityTier


@dataclass(frozen=True)
class SparsityRule:
    """How the attention entropy of a block sets the share of its tokens kept.

    Entropy at or above `high_entropy` (attention spread evenly): keep every token. At or above
    `low_entropy`: keep the `mid_keep_ratio` share with the most mass. Below (attention on a few
    tokens): keep `low_keep_ratio`. Defaults are measured by bench/kvstore_codec.py.
    `keep_multiple` rounds the kept count up to a multiple of it (capped at the block): the engine
    sets its KV page size, so the kept tokens of a loaded block fill whole pages.
    """

    # measured in bench/results/kvstore_codec_2026-12-01.md: the fewest bytes within 10% of the
    # keep-all attention error, keeping at least half the tokens (51% kept, 5.2x smaller than BF16
    # on stories260K, where keep-all INT2 is 3.2x)
    low_entropy: float = 0.9
    high_entropy: float = 0.97
    mid_keep_ratio: float = 0.25
    low_keep_ratio: float = 0.125
    keep_multiple: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_entropy <= self.high_entropy <= 1.0:
            raise ValueError(
                f"entropy thresholds need 0 <= low <= high <= 1, got low={self.low_entropy}, "
                f"high={self.high_entropy}"
            )
        for name in ("mid_keep_ratio", "low_keep_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.keep_multiple < 1:
            raise ValueError(f"keep_multiple must be >= 1, got {self.keep_multiple}")

    def tier(self, entropy: float) -> SparsityTier:
        """The branch a block of this normalised entropy falls in."""
        if entropy >= self.high_entropy:
            return SparsityTier.KEEP_ALL
        return SparsityTier.TOP_K if entropy >= self.low_entropy else SparsityTier.PRUNE

    def num_kept(self, entropy: float, num_tokens: int) -> int:
        """How many of `num_tokens` tokens to keep (at least one, a multiple of `keep_multiple` or all)."""
        ratio = {
            SparsityTier.KEEP_ALL: 1.0,
            SparsityTier.TOP_K: self.mid_keep_ratio,
            SparsityTier.PRUNE: self.low_keep_ratio,
        }[self.tier(entropy)]
        num_kept = max(1, math.ceil(ratio * num_tokens))
        return min(num_tokens, -(-num_kept // self.keep_multiple) * self.keep_multiple)


KEEP_ALL = SparsityRule(low_entropy=0.0, high_entropy=0.0)
DEFAULT_SPARSITY = SparsityRule()


def attention_entropy(token_mass: torch.Tensor) -> float:
    """Entropy of the block's attention-mass distribution over its tokens, divided by ln(T).

    1.0 means every token drew the same mass; 0.0 means one token drew all of it. A block that
    drew no mass at all (or has one token) counts as even: nothing tells its tokens apart.
    """
    mass = token_mass.double().clamp_min(0)
    total = float(mass.sum())
    if mass.numel() < 2 or total <= 0.0:
        return 1.0
    share = mass / total
    entropy = -float(torch.where(share > 0, share * share.log(), torch.zeros_like(share)).sum())
    return min(1.0, entropy / math.log(mass.numel()))


def choose_kept_tokens(token_mass: torch.Tensor, rule: SparsityRule) -> tuple[torch.Tensor, SparsityTier]:
    """`[T]` attention mass -> `[T]` bool mask of the tokens to keep, and the branch that chose it.

    Ties in mass go to the earlier token, so both codec implementations keep the same set.
    """
    check_token_mass(token_mass)
    entropy = attention_entropy(token_mass)
    num_tokens = token_mass.numel()
    num_kept = rule.num_kept(entropy, num_tokens)
    order = torch.sort(token_mass.detach().double().cpu(), descending=True, stable=True).indices
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[order[:num_kept]] = True
    return mask, rule.tier(entropy)


def check_token_mass(token_mass: torch.Tensor) -> None:
    """Attention mass must be one finite, non-negative value per token."""
    if token_mass.dim() != 1:
        raise CodecError(f"token mass must be [tokens], got shape {list(token_mass.shape)}")
    if not bool(torch.isfinite(token_mass).all()) or bool((token_mass < 0).any()):
        raise CodecError("token mass must be finite and non-negative (attention probabilities summed)")
