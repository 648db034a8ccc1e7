"""The long-context harness of bench/cold_tier_quality.py on SmolLM2, full precision, a short text.

The passkey prompt must let a model that sees the whole text answer with the key (a harness that
loses the needle reports every setting as failing), and the teacher-forced decode must score the
token fed at each step (an off-by-one would score each token's successor, and every perplexity in
the bench's table would be wrong alike): fed the model's own greedy answer, each step's argmax is
the token fed there.
"""

from __future__ import annotations

import pytest
import torch

from bench import cold_tier_quality
from services.engine.kv.tiers import TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

FULL = cold_tier_quality.ContextSetting("full", TierConfig(), uses_cold=False)
KEY = "48213"


def test_full_precision_finds_the_passkey_and_teacher_forcing_scores_its_answer(
    smollm_engine: LLMEngine,
) -> None:
    prompt = cold_tier_quality.passkey_prompt(smollm_engine, 112, depth=0.3, key=KEY)
    greedy = cold_tier_quality.run_request(smollm_engine, FULL, prompt, SamplingParams(max_new_tokens=6))
    assert KEY in greedy.text, greedy.text
    answer = list(greedy.token_ids)
    row, logprobs = cold_tier_quality.perplexity(smollm_engine, FULL, prompt + answer, len(answer), None)
    assert logprobs.argmax(-1).tolist() == answer
    chosen = logprobs.gather(1, torch.tensor(answer).view(-1, 1))
    assert abs(row.perplexity - torch.exp(-chosen.mean()).item()) < 1e-3 * row.perplexity
