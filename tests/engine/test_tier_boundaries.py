"""Tier boundaries that move with attention: the hot window grows when the sampled hot share of
attention mass is low (up to its cap), and restarts at a chat-turn or end-of-text boundary.
stories260K on the CPU."""

from __future__ import annotations

from pathlib import Path

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import PROBE_EVERY_DECODE_STEPS, LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.generation_result import ResultCollector

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside."


def _engine(model: Path, **tiers: object) -> LLMEngine:
    config = TierConfig(enabled=True, sink_tokens=4, hot_tokens=32, warm_tokens=256, group_size=16, **tiers)  # type: ignore[arg-type]
    return LLMEngine.load(
        model, device="cpu", max_batch_size=1, max_seq_len=512, progress=False, kv=KVCacheSpec(tiers=config)
    )


def _hot_grown(engine: LLMEngine) -> list[int]:
    """The hot window after each growth of one long greedy request (two probed decode steps)."""
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=2 * PROBE_EVERY_DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector)
    while not collector.done.is_set():
        engine.step()
    event = collector.final_event
    assert event is not None and event.timeline is not None
    grown = [e for e in event.timeline.events if e.name == "thermocline.kv.hot_grown"]
    return [int(e.attributes["thermocline.kv.hot_tokens"]) for e in grown]  # type: ignore[call-overload]


def test_the_hot_window_grows_by_a_group_when_warm_draws_the_attention_up_to_its_cap(
    stories_hf_dir: Path,
) -> None:
    assert _hot_grown(_engine(stories_hf_dir, max_hot_tokens=48, grow_below_hot_mass=1.0)) == [48]
    assert _hot_grown(_engine(stories_hf_dir, max_hot_tokens=96, grow_below_hot_mass=1.0)) == [48, 64]
    assert _hot_grown(_engine(stories_hf_dir, max_hot_tokens=96, grow_below_hot_mass=0.0)) == []


def test_the_hot_window_restarts_at_the_last_end_of_text_in_the_prompt(stories_hf_dir: Path) -> None:
    engine = _engine(stories_hf_dir, restart_hot_at_turns=True)
    first = engine.tokenizer.encode(PROMPT)
    prompt = [*first, engine.tokenizer.eos_token_ids[0], *engine.tokenizer.encode(PROMPT, add_bos=False)]
    engine.submit(prompt, SamplingParams(max_new_tokens=4, temperature=0.0), ResultCollector(prompt))
    engine.step()
    (seq,) = engine.scheduler.running
    assert seq.block_table.hot_floor == len(first)
    plain = _engine(stories_hf_dir)
    plain.submit(prompt, SamplingParams(max_new_tokens=4, temperature=0.0), ResultCollector(prompt))
    plain.step()
    assert plain.scheduler.running[0].block_table.hot_floor == 0
