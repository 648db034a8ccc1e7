"""Next-token choice: greedy argmax, or temperature + top-k + top-p sampling with a per-request RNG."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.scheduling.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A private RNG for one request, so its samples do not depend on its batch neighbours."""
    return torch.Generator(device=device).manual_seed(seed)


FAULT = -1  # the token id of a row whose logits or probabilities are not finite


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row of fp32 `logits` `[B, V]`; returns `[B]` int64 on the logits' device.

    A row whose numbers went bad (NaN or inf logits, or probabilities that do not form a distribution)
    gets FAULT instead of a token, so that the caller fails that row alone and the batch carries on.
    Nothing here synchronizes with the host.
    """
    token_ids = logits.argmax(dim=-1)  # [B] greedy for everyone, overwritten for sampled rows
    token_ids.masked_fill_(~torch.isfinite(logits).all(dim=-1), FAULT)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if not p.is_greedy:
            token_ids[row] = _sample_row(logits[row], p, generator)
    return token_ids


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    scaled = logits / p.temperature  # [V]
    if p.top_k > 0:
        scaled = _keep_top_k(scaled, p.top_k)
    if p.top_p < 1.0:
        scaled = _keep_top_p(scaled, p.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [V]
    # multinomial rejects NaN or inf (a device-side assert on CUDA): draw from a harmless stand-in
    # instead, and report the row as a fault.
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    drawn = torch.multinomial(torch.where(ok, probs, 1.0), num_samples=1, generator=generator)[0]
    return torch.where(ok, drawn, FAULT)


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True)  # [V]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [V] probability of strictly better tokens
    drop_sorted = mass_before >= top_p  # the top token always survives (mass_before == 0)
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
