"""Summary keys of cold blocks (Quest): the score bounds every key's dot product and finds the block a
query points at. Tiny fakes, no model."""

from __future__ import annotations

import torch

from services.engine.kv.cold_moves import ColdSummaries, quest_scores

LAYERS, TOKENS, KV_HEADS, HEADS, DIM = 2, 16, 2, 4, 8


def test_the_score_bounds_the_best_dot_product_in_each_block() -> None:
    torch.manual_seed(0)
    keys = torch.randn(5, TOKENS, KV_HEADS, DIM)  # [N, T, KVH, D]
    query = torch.randn(HEADS, DIM)
    scores = quest_scores(query, keys.amin(1), keys.amax(1))  # [N]
    grouped = query.view(KV_HEADS, HEADS // KV_HEADS, DIM)  # [KVH, G, D]
    dots = torch.einsum("hgd,nthd->nthg", grouped, keys)  # [N, T, KVH, G]
    best_per_head = dots.amax(1).sum((1, 2))  # [N]: each head's best token, summed over heads
    assert torch.all(scores >= best_per_head - 1e-5)


def test_summaries_rank_first_the_block_holding_a_key_the_query_points_at() -> None:
    torch.manual_seed(1)
    summaries = ColdSummaries(layer=1, num_kv_heads=KV_HEADS, head_dim=DIM, device=torch.device("cpu"))
    query = torch.randn(HEADS, DIM)
    for slot in range(12):  # more than the first allocation: the store grows
        keys = 0.1 * torch.randn(LAYERS, TOKENS, KV_HEADS, DIM)
        if slot == 9:
            keys[1, 3] = 3 * query.view(KV_HEADS, -1, DIM).mean(1)  # one token aligned with the query
        summaries.add("request", slot, keys)
    scores = summaries.scores("request", 12, query)
    assert int(scores.argmax()) == 9
    summaries.forget("request")
    assert "request" not in summaries
