"""LLMEngine on a tiny random Llama: greedy parity with transformers, batching, streaming, cancel."""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection
from pathlib import Path

import pytest
import torch

from services.engine.errors import EmptyPrompt, InvalidPrompt, KVCapacityExceeded, PromptTooLong
from services.engine.kv.capacity import KVBudgetTooSmall
from services.engine.kv.tiers import KVCacheSpec
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.scheduler import ScheduledBatch
from services.engine.scheduling.sequence import FinishReason, StreamEvent
from services.engine.serving.generation_result import ResultCollector
from tests.engine.fake_clock import FakeClock
from tests.engine.tiny_llama import TinySpec, make_tiny_llama

GREEDY_20 = SamplingParams(max_new_tokens=20, ignore_eos=True)


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)  # explicit: HF would otherwise infer padding from the pad id
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_single_and_batched(tiny_engine: LLMEngine, tiny_dir: Path) -> None:
    prompts = _prompts(tiny_engine.config.vocab_size, (7, 1, 33, 12))
    expected = [_hf_greedy(tiny_dir, p, 20) for p in prompts]
    single = [tiny_engine.generate([p], GREEDY_20)[0].token_ids for p in prompts]
    batched = [r.token_ids for r in tiny_engine.generate(prompts, GREEDY_20)]
    assert [list(t) for t in single] == expected
    assert [list(t) for t in batched] == expected


def test_tied_sharded_checkpoint_matches_transformers(tiny_tied_sharded_dir: Path) -> None:
    engine = LLMEngine.load(tiny_tied_sharded_dir, device="cpu", max_batch_size=2, progress=False)
    prompts = _prompts(engine.config.vocab_size, (9, 4), seed=3)
    results = engine.generate(prompts, GREEDY_20)
    assert [list(r.token_ids) for r in results] == [_hf_greedy(tiny_tied_sharded_dir, p, 20) for p in prompts]


def test_requests_joining_mid_decode_get_the_same_tokens(tiny_engine: LLMEngine) -> None:
    first, second = _prompts(tiny_engine.config.vocab_size, (10, 25), seed=5)
    alone = [tiny_engine.generate([p], GREEDY_20)[0].token_ids for p in (first, second)]
    collectors = [ResultCollector(first), ResultCollector(second)]
    tiny_engine.submit(first, GREEDY_20, collectors[0])
    for _ in range(6):  # prefill + 5 decode steps of `first` alone
        tiny_engine.step()
    tiny_engine.submit(second, GREEDY_20, collectors[1])
    while not all(c.done.is_set() for c in collectors):
        tiny_engine.step()
    assert [c.result().token_ids for c in collectors] == alone


@pytest.mark.parametrize("mixed_steps", [True, False], ids=["mixed", "prefill-first"])
def test_a_long_prompt_stalls_a_running_stream_only_without_mixed_steps(
    tiny_dir: Path, mixed_steps: bool
) -> None:
    """A 100-token prompt in chunks of 16 tokens arrives while another request decodes: with
    mixed steps that stream gets a token beside every chunk; prompts first, it waits for the whole
    prompt. Both ways every request's tokens are its tokens alone."""
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, max_prefill_tokens=16,
        mixed_steps=mixed_steps, progress=False,
    )  # fmt: skip
    short, long = _prompts(engine.config.vocab_size, (6, 100), seed=9)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    collectors = [ResultCollector(short), ResultCollector(long)]
    engine.submit(short, params, collectors[0])
    for _ in range(3):  # its prefill and two decode steps
        engine.step()
    (running,) = engine.scheduler.running
    tokens_before = len(running.completion_ids)
    engine.submit(long, params, collectors[1])
    engine.step()
    arriving = next(seq for seq in engine.scheduler.running if seq is not running)
    while not arriving.completion_ids:  # until the long prompt's first token
        engine.step()
    during = len(running.completion_ids) - tokens_before
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    alone = [list(engine.generate([p], params)[0].token_ids) for p in (short, long)]  # after: no reuse before
    assert [list(c.result().token_ids) for c in collectors] == alone
    if mixed_steps:
        assert during >= 7  # one beside each of the 7 chunks (6 of 16 tokens, then 4)
    else:
        assert during <= 1  # at most the step prepared before the prompt arrived


def test_a_prompt_whose_chunk_fails_the_step_takes_no_decoding_stream_with_it(
    tiny_dir: Path, monkeypatch
) -> None:
    """A mixed step whose forward raises (here: whenever it holds the long prompt's chunk) fails the
    long prompt's request; the stream decoding beside it goes on to its own tokens."""
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, max_prefill_tokens=16, progress=False
    )
    short, long = _prompts(engine.config.vocab_size, (6, 100), seed=11)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = list(engine.generate([short], params)[0].token_ids)
    launch = engine.runner.launch

    def failing_launch(step, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(len(row.seq.prompt_ids) == len(long) and row.num_new > 1 for row in step.rows):
            raise RuntimeError("the chunk's kernel failed")
        return launch(step, *args, **kwargs)

    collectors = [ResultCollector(short), ResultCollector(long)]
    engine.submit(short, params, collectors[0])
    engine.step()  # its prompt
    monkeypatch.setattr(engine.runner, "launch", failing_launch)
    engine.submit(long, params, collectors[1])
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    failed = collectors[1].final_event
    assert failed is not None and failed.error is not None and "the chunk's kernel failed" in failed.error
    assert list(collectors[0].result().token_ids) == alone
    assert engine.stats().num_running == 0


def test_more_requests_than_slots_all_finish(tiny_engine: LLMEngine) -> None:
    prompts = _prompts(tiny_engine.config.vocab_size, (3, 5, 8, 13, 2, 21, 34), seed=7)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 9, 2, 15, 6, 1, 11)]
    expected = [tiny_engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    results = tiny_engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert [len(r.token_ids) for r in results] == [4, 9, 2, 15, 6, 1, 11]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert tiny_engine.stats().num_free_slots == tiny_engine.max_batch_size


def test_eos_stops_and_is_reported(tiny_engine: LLMEngine) -> None:
    prompt = _prompts(tiny_engine.config.vocab_size, (6,), seed=11)[0]
    free_run = tiny_engine.generate([prompt], GREEDY_20)[0].token_ids
    eos = free_run[4]
    engine_eos = tiny_engine._eos_token_ids
    tiny_engine._eos_token_ids = frozenset({eos})  # pretend this token is EOS for the test
    try:
        result = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=20))[0]
    finally:
        tiny_engine._eos_token_ids = engine_eos
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids == free_run[: free_run.index(eos) + 1]


def test_stream_deltas_concatenate_to_the_full_decode(tiny_engine: LLMEngine) -> None:
    tokenizer = tiny_engine.tokenizer
    prompt = tokenizer.encode("Once upon a time")
    events: list[StreamEvent] = []
    tiny_engine.submit(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), events.append)
    while not (events and events[-1].finished):
        tiny_engine.step()
    completion = [t for e in events for t in e.token_ids]
    full = tokenizer.decode(prompt + completion)
    assert "".join(e.text_delta for e in events) == full[len(tokenizer.decode(prompt)) :]
    assert [e.completion_tokens for e in events] == list(range(1, 41))
    assert all(e.prompt_tokens == len(prompt) for e in events)
    assert [e.finished for e in events].count(True) == 1


def test_stop_string_ends_generation_and_is_not_emitted(tiny_engine: LLMEngine) -> None:
    prompt = _prompts(tiny_engine.config.vocab_size, (8,), seed=2)[0]
    free = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop = free.text[10:13]
    assert len(stop) == 3
    result = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))[
        0
    ]
    assert result.finish_reason is FinishReason.STOP
    assert result.text == free.text[: free.text.index(stop)]
    assert len(result.token_ids) < 30


def test_a_stop_string_seen_while_the_next_step_runs_drops_that_steps_token(tiny_engine: LLMEngine) -> None:
    """Text is made while the next step runs, so a stop string ends its row one step late: the token
    computed past the stop must not reach the result, and the row's neighbours must not notice."""
    stopping, neighbour = _prompts(tiny_engine.config.vocab_size, (8, 11), seed=2)
    free, neighbour_alone = tiny_engine.generate(
        [stopping, neighbour], SamplingParams(max_new_tokens=30, ignore_eos=True)
    )
    stop = free.text[10:13]
    params = [
        SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)),
        SamplingParams(max_new_tokens=30, ignore_eos=True),
    ]
    stopped, neighbour_batched = tiny_engine.generate([stopping, neighbour], params)
    decode = tiny_engine.tokenizer.decode
    kept = list(stopped.token_ids)
    assert stopped.finish_reason is FinishReason.STOP
    assert kept == list(free.token_ids[: len(kept)])
    assert stop in decode(stopping + kept)[len(decode(stopping)) :]  # the last kept token completes it
    assert stop not in decode(stopping + kept[:-1])[len(decode(stopping)) :]
    assert neighbour_batched.token_ids == neighbour_alone.token_ids
    assert tiny_engine.runner.kv_cache.hot.pool.num_used_blocks() == 0


def test_a_row_ended_by_eos_after_the_next_step_was_prepared_leaves_no_trace(
    tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next step is scheduled before this one's tokens are known, so a row that samples EOS is
    in it as a dead row: it must not gain a token, change its neighbour's output, or keep a block."""
    ending, neighbour = _prompts(tiny_engine.config.vocab_size, (9, 14), seed=21)
    free, neighbour_alone = tiny_engine.generate([ending, neighbour], GREEDY_20)
    eos = free.token_ids[6]  # make the 7th greedy token of the first row its EOS
    monkeypatch.setattr(tiny_engine, "_eos_token_ids", frozenset({eos}))
    params = [SamplingParams(max_new_tokens=20), GREEDY_20]
    ended, neighbour_batched = tiny_engine.generate([ending, neighbour], params)
    assert ended.finish_reason is FinishReason.STOP
    first_eos = list(free.token_ids).index(eos)
    assert list(ended.token_ids) == list(free.token_ids[: first_eos + 1])
    assert neighbour_batched.token_ids == neighbour_alone.token_ids
    assert tiny_engine.runner.kv_cache.hot.pool.num_used_blocks() == 0


def test_cancel_frees_the_slot_and_ends_the_stream(tiny_engine: LLMEngine) -> None:
    prompt = _prompts(tiny_engine.config.vocab_size, (5,), seed=4)[0]
    events: list[StreamEvent] = []
    handle = tiny_engine.submit(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True), events.append)
    for _ in range(40):  # 5 prompt + 40 tokens: three 16-token blocks held mid-stream
        tiny_engine.step()
    assert tiny_engine.stats().num_running == 1
    assert tiny_engine.runner.kv_cache.hot.pool.num_used_blocks() == 3
    tiny_engine.cancel(handle)
    tiny_engine.step()
    assert events[-1].finished and events[-1].finish_reason is FinishReason.CANCELLED
    assert tiny_engine.stats().num_running == 0
    assert tiny_engine.stats().num_free_slots == tiny_engine.max_batch_size
    assert tiny_engine.runner.kv_cache.hot.pool.num_used_blocks() == 0  # every block back at once
    tiny_engine.cancel(handle.request_id)  # cancelling a finished request is a no-op
    tiny_engine.step()
    assert sum(e.finished for e in events) == 1


def test_background_thread_serves_concurrent_submits(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=4, max_seq_len=128, progress=False)
    prompts = _prompts(engine.config.vocab_size, (4, 9, 16), seed=9)
    expected = [engine.generate([p], GREEDY_20)[0].token_ids for p in prompts]
    engine.start()
    try:
        results: dict[int, tuple[int, ...]] = {}

        def run(i: int) -> None:
            results[i] = engine.generate([prompts[i]], GREEDY_20)[0].token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert [results[i] for i in range(3)] == expected
        events: list[StreamEvent] = []
        handle = engine.submit(prompts[0], SamplingParams(max_new_tokens=200), events.append)
        engine.cancel(handle)
    finally:
        engine.stop()
    assert events[-1].finished
    assert engine.stats().num_running == 0


def test_sequence_length_is_capped_by_max_seq_len(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=1, max_seq_len=16, progress=False)
    result = engine.generate([list(range(2, 12))], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 6


def test_bad_prompts_are_rejected_with_actionable_errors(tiny_engine: LLMEngine) -> None:
    with pytest.raises(EmptyPrompt, match="no tokens"):
        tiny_engine.submit([], GREEDY_20, lambda e: None)
    with pytest.raises(PromptTooLong, match="prompt has 300 tokens but the limit is 255"):
        tiny_engine.submit([5] * 300, GREEDY_20, lambda e: None)
    with pytest.raises(InvalidPrompt, match="outside"):
        tiny_engine.submit([5, 10**6], GREEDY_20, lambda e: None)


def test_a_failing_callback_does_not_stop_the_engine(tiny_engine: LLMEngine) -> None:
    def explode(event: StreamEvent) -> None:
        raise RuntimeError("client went away")

    prompt = _prompts(tiny_engine.config.vocab_size, (5,), seed=8)[0]
    tiny_engine.submit(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), explode)
    result = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert len(result.token_ids) == 3
    assert tiny_engine.stats().num_running == 0


def test_a_repeated_prompt_reuses_cached_blocks_and_gives_the_same_tokens(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=128, progress=False)
    prompt = _prompts(engine.config.vocab_size, (40,), seed=12)[0]
    first = engine.generate([prompt], GREEDY_20)[0]
    second = engine.generate([prompt], GREEDY_20)[0]
    assert second.token_ids == first.token_ids
    assert engine.stats().num_prompt_tokens_cached == 32  # two full 16-token blocks skipped
    other_tenant = ResultCollector(prompt)
    engine.submit(prompt, GREEDY_20, other_tenant, cache_salt="tenant-b")
    while not other_tenant.done.is_set():
        engine.step()
    assert other_tenant.result().token_ids == first.token_ids
    assert engine.stats().num_prompt_tokens_cached == 32  # another salt shares nothing


def test_unknown_intent_class_is_refused_with_the_known_ones(tiny_engine: LLMEngine) -> None:
    from services.engine.errors import UnknownIntentClass

    with pytest.raises(UnknownIntentClass, match="known classes: batch, critical, interactive, standard"):
        tiny_engine.submit([5, 6], GREEDY_20, lambda e: None, intent_class="nope")


def test_refuse_policy_says_how_many_tokens_fit(tiny_dir: Path) -> None:
    from services.engine.kv.tiers import TierConfig, WarmFullPolicy

    tiers = TierConfig(
        enabled=True,
        sink_tokens=4,
        hot_tokens=32,
        warm_tokens=64,
        group_size=16,
        policy=WarmFullPolicy.REFUSE,
    )
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=1, progress=False, kv=KVCacheSpec(tiers=tiers)
    )
    with pytest.raises(KVCapacityExceeded, match="hold 100 tokens per request"):
        engine.submit([5] * 90, GREEDY_20, lambda e: None)
    assert len(engine.generate([[5] * 70], GREEDY_20)[0].token_ids) == 20


def test_a_warm_group_that_does_not_tile_the_head_is_refused_at_load(tmp_path: Path) -> None:
    """Head dim 24 with the tiers on and group size 16: values would be quantized in groups of 16
    channels, which do not tile 24, and the first demotion would fail mid-request. The load says
    so instead; a group of 32 (one group of 24 channels a token) loads and demotes."""
    from services.engine.kv.tiers import TierConfig

    path = make_tiny_llama(tmp_path / "head24", TinySpec(hidden_size=96))  # 4 heads of 24
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=16, warm_tokens=256, group_size=16)
    with pytest.raises(ValueError, match="groups of min\\(group_size, head dim\\) = 16 channels"):
        LLMEngine.load(path, device="cpu", max_batch_size=1, progress=False, kv=KVCacheSpec(tiers=tiers))
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=16, warm_tokens=256, group_size=32)
    engine = LLMEngine.load(path, device="cpu", max_batch_size=1, progress=False, kv=KVCacheSpec(tiers=tiers))
    prompt = _prompts(engine.config.vocab_size, (100,), seed=3)[0]
    events: list[StreamEvent] = []
    engine.submit(prompt, GREEDY_20, events.append)
    warm_held = 0
    while not any(e.finished for e in events):
        engine.step()
        warm_held = max(warm_held, engine.stats().num_warm_tokens)
    assert warm_held > 0 and sum(len(e.token_ids) for e in events) == 20


def test_a_cached_prefix_row_batched_with_a_full_prompt_stays_within_max_seq_len(tiny_dir: Path) -> None:
    # the cached row starts at 32 with 8 new tokens next to a 40-token prompt: its padding must
    # not run past position 63 (found on CUDA as an out-of-range RoPE gather)
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    cached, fresh = _prompts(engine.config.vocab_size, (40, 40), seed=13)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in (cached, fresh)]
    engine2 = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, progress=False)
    engine2.generate([cached], params)
    results = engine2.generate([cached, fresh], params)
    assert engine2.stats().num_prompt_tokens_cached == 32
    assert [r.token_ids for r in results] == alone


def test_a_poisoned_row_fails_alone_and_its_batch_neighbours_are_unchanged(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=8, max_seq_len=256, progress=False)
    prompts = _prompts(engine.config.vocab_size, (5, 9, 3, 17, 8, 12, 6, 10), seed=11)
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    params = [GREEDY_20, *sampled, GREEDY_20, GREEDY_20, GREEDY_20]
    # Row 3 divides its logits by 1e-40: the validation that refuses this sits above the engine, so
    # the value is planted past it, as a numerical fault from any other cause would arrive.
    poisoned = SamplingParams(max_new_tokens=12, temperature=0.5, seed=3, ignore_eos=True)
    object.__setattr__(poisoned, "temperature", 1e-40)
    params[3] = poisoned
    alone = [engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    together = engine.generate(prompts, params)
    assert together[3].finish_reason is FinishReason.ERROR and alone[3].finish_reason is FinishReason.ERROR
    assert "numerical fault" in (together[3].error or "")
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert together[i].error is None
        assert together[i].token_ids == alone[i].token_ids, f"row {i} changed beside the poisoned row"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", 1e-40, "temperature must be 0"),
        ("temperature", float("nan"), "temperature"),
        ("temperature", 1e6, "temperature"),
        ("top_p", float("nan"), "top_p"),
        ("top_k", 1 << 40, "top_k"),
        ("stop", ("x" * 10_000,), "at most 256 characters"),
    ],
)
def test_sampling_parameters_outside_their_ranges_are_refused(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{field: value})


def test_max_seq_len_defaults_to_the_model_limit_and_the_pools_report_their_capacity(tiny_dir: Path) -> None:
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=3, progress=False)
    assert engine.max_seq_len == engine.config.max_position_embeddings
    plan = engine.capacity
    assert plan is not None and plan.concurrent_sequences == 3  # the CPU stops at what the batch needs
    assert plan.hot_tokens >= 3 * engine.max_seq_len and plan.kv_bytes <= plan.budget_bytes


def test_a_kv_budget_below_one_sequence_caps_max_seq_len_or_refuses_with_the_numbers(tmp_path: Path) -> None:
    # 4 layers x 4 KV heads x dim 64 x K and V x fp32 = 8 KiB per token: 1 MiB is 8 blocks of 16 tokens,
    # 7 past the scratch block, so 112 tokens; the model's own limit is 512
    wide = make_tiny_llama(tmp_path / "wide", TinySpec(hidden_size=256, num_layers=4, num_kv_heads=4))
    one_mib = KVCacheSpec(block_size=16, cpu_cache_mb=1)
    engine = LLMEngine.load(wide, device="cpu", max_batch_size=2, kv=one_mib, progress=False)
    assert engine.max_seq_len == 112
    assert engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].error is None
    with pytest.raises(KVBudgetTooSmall, match=r"max_seq_len 512 needs 4.00 MiB .* 1.00 MiB .* 112 tokens"):
        LLMEngine.load(wide, device="cpu", max_seq_len=512, kv=one_mib, progress=False)


def test_a_request_larger_than_the_whole_hot_pool_is_refused_with_the_numbers(tiny_dir: Path) -> None:
    tight = KVCacheSpec(block_size=16, num_hot_blocks=9)  # set by hand: 8 usable blocks, 128 tokens
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, kv=tight)
    with pytest.raises(KVCapacityExceeded, match="hot KV pool holds 128 tokens in all"):
        engine.submit(list(range(2, 100)), SamplingParams(max_new_tokens=64), lambda e: None)


class RecordingCondition(threading.Condition):
    """The engine's lock, reporting each wait that has a timeout (the idle wait has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed_waits: queue.Queue[float] = queue.Queue()

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.timed_waits.put(timeout)
        return super().wait(timeout)


def test_the_step_thread_sleeps_until_the_queue_timeout_when_no_request_can_start(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued request no step can start (here the scheduler lets no class start) leaves the step
    thread asleep until that request's queue timeout, after one empty step; it used to spin through
    empty steps, a core at 100%, until the timeout. A wake-up then ends the request as timed out."""
    classes = IntentClasses({"standard": IntentClass("standard", queue_timeout_s=600.0)})
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=2, max_seq_len=64, classes=classes)
    clock = FakeClock()
    engine.scheduler.clock = clock
    monkeypatch.setattr(engine.scheduler, "_class_may_start", lambda cls: False)
    schedule = engine.scheduler.schedule
    num_schedules = 0

    def counted_schedule(ending: Collection[int] = ()) -> ScheduledBatch | None:
        nonlocal num_schedules
        num_schedules += 1
        return schedule(ending)

    monkeypatch.setattr(engine.scheduler, "schedule", counted_schedule)
    lock = engine._lock = RecordingCondition()
    engine.start()
    try:
        collector = ResultCollector([5, 6, 7])
        engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4), collector)
        assert lock.timed_waits.get(timeout=30) == 600.0  # asleep until the timeout, on the fake clock
        assert num_schedules == 1 and not collector.done.is_set()
        clock.now = 601.0
        with lock:
            lock.notify()  # as a kvstore outcome would: the thread steps once more and expires it
        assert collector.done.wait(timeout=30)
    finally:
        engine.stop()
    final = collector.final_event
    assert final is not None and final.error_status == "deadline_exceeded"
    assert "600" in (final.error or "")


@pytest.mark.parametrize("fail_at", [3, 8], ids=["mid-stream", "last-token"])
def test_a_row_whose_text_stage_raises_fails_alone(tiny_dir: Path, monkeypatch, fail_at: int) -> None:
    """One sequence's detokenizer raises at its `fail_at`-th token (the last one: its final event
    is still sent). That request ends with the error; its batch neighbours' tokens are unchanged."""
    engine = LLMEngine.load(tiny_dir, device="cpu", max_batch_size=3, max_seq_len=128, progress=False)
    prompts = _prompts(engine.config.vocab_size, (5, 9, 7), seed=17)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    collectors = [ResultCollector(p) for p in prompts]
    for prompt, collector in zip(prompts, collectors, strict=True):
        engine.submit(prompt, params, collector)
    engine.step()  # the three prompts, in one step
    broken = next(seq for seq in engine.scheduler.running if list(seq.prompt_ids) == prompts[1])
    push, num_pushed = broken._detokenizer.push, [0]

    def failing_push(token_id: int) -> str:
        num_pushed[0] += 1
        if num_pushed[0] == fail_at:
            raise RuntimeError("the detokenizer broke")
        return push(token_id)

    monkeypatch.setattr(broken._detokenizer, "push", failing_push)
    while not all(c.done.is_set() for c in collectors):
        engine.step()
    failed = collectors[1].final_event
    assert failed is not None and failed.finish_reason is FinishReason.ERROR
    assert "RuntimeError: the detokenizer broke" in (failed.error or "")
    for i in (0, 2):
        assert collectors[i].result().error is None
        assert collectors[i].result().token_ids == alone[i], f"row {i} failed beside the broken row"
    assert engine.stats().num_running == 0 and engine.stats().num_hot_tokens == 0
