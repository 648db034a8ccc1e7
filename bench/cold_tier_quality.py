"""The cold tier's quality on SmolLM2-135M-Instruct (CPU, fp32): the entropy rule's thresholds, and
long context with and without the auxiliary window.

Part `thresholds` (an emulation: the engine never prunes, see below). The model reads the first
`--tokens` tokens of the kv_quality text in chunks of `--chunk`, all in the hot cache, exact. Every
32-token group (the engine's cold block: one warm group) older than the last `--recent` tokens is
round-tripped once through the real INT2-sparse codec (`encode_block` then `decode_block`) and
written back; the tokens the entropy rule dropped are masked out of attention from then on. Each
token's mass is the attention it drew from the `--history` queries before its group went cold,
summed over layers and heads (what an engine has seen at demotion). Every cold block is attended,
as if the auxiliary window held them all, so the table isolates the codec: perplexity and
KL(full || emulated) over the positions that had cold context, against encode + decode time per
block. Attention is computed explicitly (softmax, then the mass is read) for the reference too.
Codec time is measured apart, after the runs: every setting encodes and decodes the same cold
blocks (keys, values and mass from the exact run), settings interleaved, best of `--repeats` per
block, median over blocks, so the load that other work puts on the CPU falls on all alike.

Why an emulation: no attention mass reaches the engine's demotions. With pruning off (the
default) the engine keeps every token; with `THERMOCLINE_ENGINE_COLD_PRUNE_TOKENS` on it ranks
tokens by a key-norm proxy (`services/engine/kv/cold_tier.py`, `key_norm_mass`) and keeps whole
16-token pages. The matrix measures the rule with the mass an engine would want.

Part `pruning` (the same emulation): what the engine's pruning changes. The default rule with
the engine's page rounding, its tokens ranked by real attention mass, by the key-norm proxy (what
the engine does), and by random mass (a control); then half of every block kept, by each mass,
so the ranking is compared at one count. Also the entropy deciles of the proxy's mass against
real attention's, since the entropy rule reads the proxy as if it were attention.

Part `long-context` (the real engine, with a redis-server and a kvstore process for the cold
setting). Three settings: full precision (tiers off); hot + INT4 warm with a sliding window
(warm overflow dropped); hot + warm + cold with the auxiliary window (retrieval mode
`semantic`, warm overflow demoted INT2 to the kvstore). Prompts are prefilled in chunks of
`--prefill-chunk` tokens, so tiers move during the prompt as they do in serving.
- Perplexity: the first `--context - --tail` tokens of the text are the prompt; the last
  `--tail` tokens are decoded teacher-forced (the engine's sampler is swapped for one that records
  log p(next text token) and returns that token), so every tail token runs a real decode step.
- Passkey: a 5-digit number planted at each `--depths` fraction of a `--context`-token filler text,
  asked for at the end; greedy decoding; found when the digits appear in the answer.
Part `forced-passkey`: the same prompts stopped before the question; the question and the key
are teacher-forced, so the window (scored on decode steps only) has the question's steps to bring
the needle back before the key's tokens are scored.

    .venv/bin/python bench/cold_tier_quality.py thresholds --out bench/results/cold_tier_thresholds_<date>.md
    .venv/bin/python bench/cold_tier_quality.py pruning --out bench/results/cold_tier_pruning_<date>.md
    .venv/bin/python bench/cold_tier_quality.py long-context --context 4096 \
        --out bench/results/cold_tier_long_context_<date>.md
    .venv/bin/python bench/cold_tier_quality.py forced-passkey --context 4096 --depths 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cold_tier, kv_quality
from services.common.kv_codec.codec import CodecSettings, decode_block, encode_block, read_layout
from services.common.kv_codec.sparsity import (
    DEFAULT_SPARSITY,
    KEEP_ALL,
    SparsityRule,
    attention_entropy,
)
from services.common.service_auth import TOKEN_FILE_SETTING
from services.engine import llm_engine as llm_engine_module
from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata, RowInput
from services.engine.attention.reference import dense_context, pad_queries, token_rows
from services.engine.kv import cold_tier as cold_tier_module
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import HotTier, KVCache
from services.engine.kv.cold_tier import ColdTierConfig, key_norm_mass
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model.llama import LlamaModel
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from services.engine.scheduling.sampling_params import SamplingParams
from tests.kvstore.conftest import KVStoreProcess, RedisServer

BLOCK_SIZE = kv_quality.BLOCK_SIZE  # 16: the first block (4 sink tokens) stays exact
COLD_GROUP = 32  # tokens per cold block: one warm group at the engine's default group size
MASS_SOURCES = ("attention", "key norm", "random")  # what ranks a block's tokens (RuleSetting.mass)


# --- part 1: thresholds ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleSetting:
    """One row of the matrix: a sparsity rule, or None for exact cold tokens (`drop` drops them all)."""

    name: str
    rule: SparsityRule | None
    drop: bool = False
    mass: str = "attention"  # one of MASS_SOURCES


class MaskedBackend(AttentionBackend):
    """The reference gather with an explicit softmax: dropped cold tokens are masked out, and the
    mass each position draws (summed over layers, heads and the chunk's queries) is kept."""

    def __init__(self, kv_cache: KVCache, num_positions: int) -> None:
        self.kv_cache = kv_cache
        self.kept = torch.ones(num_positions, dtype=torch.bool)  # [N]
        self.chunk_mass = torch.zeros(num_positions, dtype=torch.float64)  # [N]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`[T, H, D]` -> `[T, H, D]`, one row."""
        context = dense_context(self.kv_cache, layer, metadata)
        rows, offsets = token_rows(metadata)
        queries = pad_queries(q, rows, offsets, metadata)  # [1, H, S, D]
        num_positions = context.keys.shape[2]
        visible = context.visible & self.kept[:num_positions]  # [1, 1, S, L]
        repeat = queries.shape[1] // context.keys.shape[1]
        keys = context.keys.repeat_interleave(repeat, dim=1)  # [1, H, L, D]
        values = context.values.repeat_interleave(repeat, dim=1)
        scores = queries @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])  # [1, H, S, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        self.chunk_mass[:num_positions] += probs.sum((0, 1, 2)).double()
        return (probs @ values).transpose(1, 2)[rows, offsets]  # [T, H, D]


class ColdSample(NamedTuple):
    """One cold block as the exact run saw it: keys and values `[L, G, KVH, D]` and mass `[G]`."""

    keys: torch.Tensor
    values: torch.Tensor
    mass: torch.Tensor


@dataclass
class CodecTally:
    """What the rule kept over the cold blocks of one run, and their payload bytes."""

    payload_bytes: int = 0
    num_tokens: int = 0
    num_kept: int = 0


def group_block_ids(table: BlockTable, first: int) -> torch.Tensor:
    """Hot block ids `[G/BS]` of the cold group starting at position `first`."""
    return torch.tensor(table.hot_block_ids[first // BLOCK_SIZE : (first + COLD_GROUP) // BLOCK_SIZE])


def read_group(cache: KVCache, table: BlockTable, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[L, G, KVH, D]` of the group starting at `first`."""
    ids = group_block_ids(table, first)
    num_layers, _, _, heads, dim = cache.hot.keys.shape
    shape = (num_layers, COLD_GROUP, heads, dim)
    return cache.hot.keys[:, ids].reshape(shape), cache.hot.values[:, ids].reshape(shape)


def round_trip(
    cache: KVCache, table: BlockTable, backend: MaskedBackend, first: int, mass: torch.Tensor,
    rule: SparsityRule, tally: CodecTally,
) -> None:  # fmt: skip
    """Replace one group's keys and values by their codec round trip; mask what it dropped."""
    keys, values = read_group(cache, table, first)
    payload = encode_block(keys, values, mass.float(), CodecSettings(sparsity=rule))
    decoded = decode_block(payload)
    tally.payload_bytes += len(payload)
    tally.num_tokens += COLD_GROUP
    tally.num_kept += int(decoded.token_mask.sum())
    ids = group_block_ids(table, first)
    num_layers, _, _, heads, dim = cache.hot.keys.shape
    dense_keys, dense_values = decoded.to_dense()  # [L, G, KVH, D], zeros where dropped
    cache.hot.keys[:, ids] = dense_keys.view(num_layers, -1, BLOCK_SIZE, heads, dim)
    cache.hot.values[:, ids] = dense_values.view(num_layers, -1, BLOCK_SIZE, heads, dim)
    backend.kept[first : first + COLD_GROUP] = decoded.token_mask


@dataclass
class EmulatedRun:
    """Log-probabilities `[N-1, V]` of one run, what the codec kept, and the exact run's cold blocks."""

    logprobs: torch.Tensor
    tally: CodecTally
    samples: list[ColdSample]


def go_cold(
    cache: KVCache, table: BlockTable, backend: MaskedBackend, first: int, mass: torch.Tensor,
    setting: RuleSetting, run: EmulatedRun,
) -> None:  # fmt: skip
    """The group at `first` leaves the recent window: exact (sampled), dropped, or round-tripped."""
    if setting.drop:
        backend.kept[first : first + COLD_GROUP] = False
    elif setting.rule is None:
        run.samples.append(ColdSample(*(t.clone() for t in read_group(cache, table, first)), mass.float()))
    else:
        ranking = ranking_mass(setting.mass, read_group(cache, table, first)[0], mass, first)
        round_trip(cache, table, backend, first, ranking, setting.rule, run.tally)


def ranking_mass(source: str, keys: torch.Tensor, attention: torch.Tensor, first: int) -> torch.Tensor:
    """The `[G]` mass that ranks a group's tokens: its real attention, the engine's key-norm proxy
    over its keys `[L, G, KVH, D]`, or random (seeded by the group's position, the same every run)."""
    if source == "key norm":
        return key_norm_mass(keys)
    if source == "random":
        return torch.rand(COLD_GROUP, generator=torch.Generator().manual_seed(first))
    return attention


def run_emulated(
    model: LlamaModel, ids: list[int], setting: RuleSetting, args: argparse.Namespace
) -> EmulatedRun:
    """Chunked forward over `ids`; groups past the recent window go cold once, in order."""
    device = model.embed_tokens.weight.device
    hot = HotTier(model.config, len(ids) // BLOCK_SIZE + 2, BLOCK_SIZE, device, torch.float32)
    cache = KVCache(hot, None)
    table = BlockTable(TierConfig())
    backend = MaskedBackend(cache, len(ids))
    history: deque[torch.Tensor] = deque(maxlen=max(1, args.history // args.chunk))
    run, outputs = EmulatedRun(torch.empty(0), CodecTally(), []), []
    next_cold = BLOCK_SIZE
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, args.chunk):
            piece = ids[start : min(start + args.chunk, len(ids) - 1)]
            cache.grow(table, start + len(piece))
            metadata = AttentionMetadata.for_rows([RowInput(table, start, len(piece))], BLOCK_SIZE, 1, device)
            backend.chunk_mass.zero_()
            hidden = model(torch.tensor(piece, device=device), cache, backend, metadata)  # [S, E]
            outputs.append(F.log_softmax(model.compute_logits(hidden), dim=-1))
            history.append(backend.chunk_mass.clone())
            while next_cold + COLD_GROUP <= start + len(piece) - args.recent:
                mass = torch.stack(list(history)).sum(0)[next_cold : next_cold + COLD_GROUP]  # [G]
                go_cold(cache, table, backend, next_cold, mass, setting, run)
                next_cold += COLD_GROUP
    run.logprobs = torch.cat(outputs)
    return run


def codec_ms(
    samples: list[ColdSample], settings: list[RuleSetting], repeats: int
) -> dict[str, tuple[float, float]]:
    """Median over blocks of the best encode and decode ms per block, per coded setting."""
    coded = [s for s in settings if s.rule is not None]
    best: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for setting in coded:
            assert setting.rule is not None
            codec = CodecSettings(sparsity=setting.rule)
            for n, sample in enumerate(samples):
                began = time.perf_counter()
                payload = encode_block(sample.keys, sample.values, sample.mass, codec)
                encoded = time.perf_counter()
                decode_block(payload)
                times = [1000 * (encoded - began), 1000 * (time.perf_counter() - encoded)]
                seen = best.setdefault((setting.name, n), times)
                best[(setting.name, n)] = [min(a, b) for a, b in zip(seen, times, strict=True)]
    return {
        s.name: (
            statistics.median(best[(s.name, n)][0] for n in range(len(samples))),
            statistics.median(best[(s.name, n)][1] for n in range(len(samples))),
        )
        for s in coded
    }


@dataclass(frozen=True)
class ThresholdRow:
    """One row of the thresholds matrix."""

    setting: RuleSetting
    perplexity: float
    mean_kl: float
    p99_kl: float
    kept_share: float
    bytes_per_cold_token: float
    encode_ms: float = float("nan")
    decode_ms: float = float("nan")


def score(
    run: EmulatedRun, ids: list[int], reference: torch.Tensor, first: int
) -> tuple[float, float, float]:
    """Perplexity, mean and p99 KL(full || run) over the predictions from position `first` on."""
    logprobs, base = run.logprobs[first:], reference[first:]
    targets = torch.tensor(ids[first + 1 :])
    nll = -logprobs.gather(1, targets.view(-1, 1)).squeeze(1)
    kl = (base.exp() * (base - logprobs)).sum(-1).clamp_min(0)
    return math.exp(nll.mean().item()), kl.mean().item(), kl.quantile(0.99).item()


def threshold_settings(cuts: list[float], keeps: list[float]) -> list[RuleSetting]:
    """Exact, keep-all INT2, every (cut, keep) pair, the shipped default, and dropping cold outright.

    `cut` is `high_entropy`: a block whose entropy is below it loses tokens. `keep` is
    `mid_keep_ratio` (the issue's beta is 1/keep); `low_keep_ratio` is half of it and `low_entropy`
    sits as far below the cut as in the default rule (0.9 / 0.97, keep 0.25 / 0.125).
    """
    out = [RuleSetting("exact (no codec)", None), RuleSetting("INT2, keep all (KEEP_ALL)", KEEP_ALL)]
    gap = DEFAULT_SPARSITY.high_entropy - DEFAULT_SPARSITY.low_entropy
    rules = [SparsityRule(round(max(0.0, c - gap), 4), c, k, k / 2) for c in cuts for k in keeps]
    if DEFAULT_SPARSITY not in rules:
        rules.append(DEFAULT_SPARSITY)
    for rule in rules:
        tag = " **(default)**" if rule == DEFAULT_SPARSITY else ""
        out.append(RuleSetting(_rule_name(rule) + tag, rule))
    out.append(RuleSetting("cold dropped (no cold tier)", None, drop=True))
    return out


def _rule_name(rule: SparsityRule) -> str:
    cut = f"high {rule.high_entropy:g}, low {rule.low_entropy:g}"
    return f"{cut}, keep {rule.mid_keep_ratio:g}/{rule.low_keep_ratio:g}"


def pruning_settings() -> list[RuleSetting]:
    """Exact, keep-all INT2, the default rule on pages of 16 by each mass, half kept by each mass,
    and the default rule unpaged by attention (the thresholds matrix's row), then cold dropped."""
    paged = dataclasses.replace(DEFAULT_SPARSITY, keep_multiple=BLOCK_SIZE)
    half = SparsityRule(low_entropy=0.0, high_entropy=1.0, mid_keep_ratio=0.5, keep_multiple=BLOCK_SIZE)
    out = [RuleSetting("exact (no codec)", None), RuleSetting("INT2, keep all (pruning off)", KEEP_ALL)]
    out.append(RuleSetting("default rule, unpaged, by attention", DEFAULT_SPARSITY))
    for source in MASS_SOURCES:
        tag = " **(the engine, pruning on)**" if source == "key norm" else ""
        out.append(RuleSetting(f"default rule, pages of {BLOCK_SIZE}, by {source}{tag}", paged, mass=source))
    for source in MASS_SOURCES:
        out.append(RuleSetting(f"half of every block, by {source}", half, mass=source))
    out.append(RuleSetting("cold dropped (no cold tier)", None, drop=True))
    return out


def thresholds(
    engine: LLMEngine, args: argparse.Namespace, settings: list[RuleSetting]
) -> tuple[list[ThresholdRow], list[ColdSample]]:
    """The matrix; also every cold block of the exact run (keys, values, attention mass)."""
    ids = engine.tokenizer.encode(kv_quality.load_text()[: 8 * args.tokens])[: args.tokens]
    model = engine.runner.model
    first = BLOCK_SIZE + COLD_GROUP + args.recent  # the first position whose context holds a cold block
    rows: list[ThresholdRow] = []
    reference: torch.Tensor | None = None
    samples: list[ColdSample] = []
    for setting in settings:
        began = time.perf_counter()
        run = run_emulated(model, ids, setting, args)
        if reference is None:
            reference, samples = run.logprobs, run.samples
        rows.append(threshold_row(setting, run, score(run, ids, reference, first)))
        print(f"{setting.name:<52} {rows[-1]} ({time.perf_counter() - began:.0f} s)", flush=True)
    if args.repeats:
        times = codec_ms(samples, settings, args.repeats)
        rows = [dataclasses.replace(r, **_times(times.get(r.setting.name))) for r in rows]
    return rows, samples


def _times(times: tuple[float, float] | None) -> dict[str, float]:
    return {} if times is None else {"encode_ms": times[0], "decode_ms": times[1]}


def threshold_row(
    setting: RuleSetting, run: EmulatedRun, quality: tuple[float, float, float]
) -> ThresholdRow:
    """The row of one run (codec times come later)."""
    t = run.tally
    coded = t.num_tokens > 0
    return ThresholdRow(
        setting, *quality,
        kept_share=t.num_kept / t.num_tokens if coded else (0.0 if setting.drop else 1.0),
        bytes_per_cold_token=t.payload_bytes / t.num_tokens if coded else float("nan"),
    )  # fmt: skip


# --- part 2: long context on the real engine ---------------------------------------------------


class TeacherForcing:
    """Stands in for the engine's sampler: records log p(next text token) and returns that token."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.logprobs: list[torch.Tensor] = []  # [V] per step

    def __call__(self, logits: torch.Tensor, params: object, draw_keys: object) -> torch.Tensor:
        """`[1, V]` logits -> `[1]` the text's next token."""
        self.logprobs.append(F.log_softmax(logits[0].float(), dim=-1).cpu())
        return torch.tensor([self.targets[len(self.logprobs) - 1]], device=logits.device)


@contextmanager
def teacher_forced(targets: list[int]) -> Iterator[TeacherForcing]:
    """The engine samples the given tokens while the block runs."""
    teacher = TeacherForcing(targets)
    original = llm_engine_module.sample
    llm_engine_module.sample = teacher  # type: ignore[assignment]
    try:
        yield teacher
    finally:
        llm_engine_module.sample = original


@dataclass(frozen=True)
class ContextSetting:
    """One long-context configuration of the engine."""

    name: str
    tiers: TierConfig
    uses_cold: bool
    prunes: bool = False  # THERMOCLINE_ENGINE_COLD_PRUNE_TOKENS


CONTEXT_SETTINGS = ("full", "sliding", "cold", "pruned")  # what --settings names


def context_settings(args: argparse.Namespace) -> list[ContextSetting]:
    """The `--settings` of: full precision, hot + warm with a sliding window, hot + warm + cold with
    the window, and the same with the cold blocks pruned."""
    tiers = TierConfig(
        enabled=True, sink_tokens=4, hot_tokens=args.hot, warm_tokens=args.warm, group_size=COLD_GROUP
    )
    cold = f"hot {args.hot} + warm {args.warm} + cold, window {args.window} (semantic)"
    by_name = {
        "full": ContextSetting("full precision (tiers off)", TierConfig(), uses_cold=False),
        "sliding": ContextSetting(
            f"hot {args.hot} + warm {args.warm}, sliding window", tiers, uses_cold=False
        ),
        "cold": ContextSetting(cold, tiers, uses_cold=True),
        "pruned": ContextSetting(cold + ", pruned", tiers, uses_cold=True, prunes=True),
    }
    return [by_name[name] for name in args.settings]


def load_engine(setting: ContextSetting, target: str, args: argparse.Namespace) -> LLMEngine:
    """A fresh fp32 CPU engine for one setting."""
    cold = None
    if setting.uses_cold:
        cold = ColdTierConfig(
            target=target, deadline_ms=10_000, prefix_reuse=False, aux_window_tokens=args.window,
            score_every_steps=args.score_every, prune_tokens=setting.prunes, score_layer=args.score_layer,
        )  # fmt: skip
    return LLMEngine.load(
        resolve_model(DEFAULT_MODEL), device="cpu", dtype="float32", max_batch_size=1,
        max_seq_len=args.context + 64, progress=False, max_prefill_tokens=args.prefill_chunk,
        kv=KVCacheSpec(cpu_cache_mb=args.kv_mb, tiers=setting.tiers), cold=cold,
    )  # fmt: skip


def run_request(engine: LLMEngine, setting: ContextSetting, prompt: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    """One request stepped on this thread; retrieval mode `semantic` for the cold setting."""
    from services.engine.serving.generation_result import ResultCollector

    collector = ResultCollector(prompt)
    engine.submit(prompt, params, collector, retrieval_mode="semantic" if setting.uses_cold else "")
    while not collector.done.is_set():
        engine.step()
    return collector.result()


@dataclass(frozen=True)
class PerplexityRow:
    """Perplexity of the teacher-forced tail, and KL to the full-precision run."""

    perplexity: float
    mean_kl: float
    seconds: float
    window_loads: int
    blocks_demoted: int


def perplexity(
    engine: LLMEngine, setting: ContextSetting, ids: list[int], tail: int, reference: torch.Tensor | None
) -> tuple[PerplexityRow, torch.Tensor]:
    """Prompt `ids[:-tail]`, then `tail` teacher-forced decode steps."""
    prompt, targets = ids[:-tail], ids[-tail:]
    params = SamplingParams(max_new_tokens=tail, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    with teacher_forced(targets) as teacher:
        run_request(engine, setting, prompt, params)
    seconds = time.perf_counter() - began
    logprobs = torch.stack(teacher.logprobs)  # [tail, V]
    nll = -logprobs.gather(1, torch.tensor(targets).view(-1, 1)).squeeze(1)
    base = logprobs if reference is None else reference
    kl = (base.exp() * (base - logprobs)).sum(-1).clamp_min(0)
    loads, demoted = cold_counts(engine)
    return PerplexityRow(math.exp(nll.mean().item()), kl.mean().item(), seconds, loads, demoted), logprobs


def cold_counts(engine: LLMEngine) -> tuple[int, int]:
    """Window loads and demoted blocks so far (0, 0 without a cold tier)."""
    stats = engine.stats().cold
    return (stats.window_loads, stats.blocks_demoted) if stats else (0, 0)


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important info there.\n"
)
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(engine: LLMEngine, num_tokens: int, depth: float, key: str) -> list[int]:
    """About `num_tokens` tokens: filler with `key` planted `depth` of the way in, then the question."""
    tokenizer = engine.tokenizer
    intro, question = tokenizer.encode(PASSKEY_INTRO), tokenizer.encode(PASSKEY_QUESTION, add_bos=False)
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_bos=False)
    filler = tokenizer.encode(FILLER * (num_tokens // 10), add_bos=False)
    room = num_tokens - len(intro) - len(question) - len(needle)
    at = int(room * depth)
    return intro + filler[:at] + needle + filler[at:room] + question


@dataclass(frozen=True)
class PasskeyResult:
    """One planted key and what the engine answered."""

    depth: float
    key: str
    answer: str
    found: bool
    digits_right: int


def passkey(
    engine: LLMEngine, setting: ContextSetting, args: argparse.Namespace, depth: float, key: str
) -> PasskeyResult:
    """Plant `key`, ask for it, greedy."""
    prompt = passkey_prompt(engine, args.context, depth, key)
    result = run_request(engine, setting, prompt, SamplingParams(max_new_tokens=args.answer_tokens))
    digits = "".join(c for c in result.text if c.isdigit())[: len(key)]
    right = sum(a == b for a, b in zip(digits, key, strict=False))
    return PasskeyResult(depth, key, result.text.strip(), key in result.text, right)


@dataclass(frozen=True)
class ForcedPasskey:
    """A planted key read teacher-forced: the question and the key are fed as decode steps."""

    depth: float
    key: str
    digits_right: int  # key tokens that were the argmax where they were fed
    num_key_tokens: int
    mean_logprob: float  # log p of the key tokens, mean
    window_loads: int


def forced_passkey(
    engine: LLMEngine, setting: ContextSetting, args: argparse.Namespace, depth: float, key: str
) -> ForcedPasskey:
    """The prompt stops before the question; the question and the key are teacher-forced, so the
    window has the question's decode steps to find the key before the key's tokens are scored."""
    tokenizer = engine.tokenizer
    prompt = passkey_prompt(engine, args.context, depth, key)
    question = tokenizer.encode(PASSKEY_QUESTION, add_bos=False)
    asked = tokenizer.encode(PASSKEY_QUESTION + " " + key, add_bos=False)
    if asked[: len(question)] != question:
        raise ValueError("the question tokenizes differently with the key after it")
    context, targets = prompt[: -len(question)], asked
    num_key = len(asked) - len(question)
    loads_before, _ = cold_counts(engine)
    with teacher_forced(targets) as teacher:
        run_request(engine, setting, context, SamplingParams(max_new_tokens=len(targets), ignore_eos=True))
    logprobs = torch.stack(teacher.logprobs)[-num_key:]  # [K, V]
    wanted = torch.tensor(targets[-num_key:])
    right = int((logprobs.argmax(-1) == wanted).sum())
    mean = logprobs.gather(1, wanted.view(-1, 1)).mean().item()
    return ForcedPasskey(depth, key, right, num_key, mean, cold_counts(engine)[0] - loads_before)


def forced_passkeys(args: argparse.Namespace) -> list[tuple[ContextSetting, list[ForcedPasskey]]]:
    """Every setting, every depth, teacher-forced (same keys as `long-context` with the same seed)."""
    rng = random.Random(args.seed)
    keys = [str(rng.randrange(10_000, 100_000)) for _ in args.depths]
    out = []
    with tempfile.TemporaryDirectory(prefix="cold-tier-quality-") as tmp:
        redis = RedisServer(Path(tmp)).start()
        kvstore = KVStoreProcess(Path(tmp) / "kvstore", redis.url).start()
        os.environ[TOKEN_FILE_SETTING] = str(kvstore.service_token_path)  # call it as the engine does
        try:
            for setting in context_settings(args):
                engine = load_engine(setting, kvstore.target, args)
                found = [
                    forced_passkey(engine, setting, args, d, k)
                    for d, k in zip(args.depths, keys, strict=True)
                ]
                print(setting.name, found, flush=True)
                out.append((setting, found))
                if engine.cold is not None:
                    engine.cold.tier.close()
        finally:
            kvstore.stop()
            redis.stop()
    return out


def forced_markdown(rows: list[tuple[ContextSetting, list[ForcedPasskey]]], args: argparse.Namespace) -> str:
    """The teacher-forced passkey table."""
    lines = [
        f"Teacher-forced passkey at {args.context} tokens: `{forced_command(args)}`",
        "",
        "| setting | depth | key | key tokens argmax-right | mean log p(key token) | window loads |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for setting, found in rows:
        for f in found:
            lines.append(
                f"| {setting.name} | {f.depth:g} | {f.key} | {f.digits_right}/{f.num_key_tokens} | "
                f"{f.mean_logprob:.2f} | {f.window_loads} |"
            )
    return "\n".join(lines) + "\n"


def _long_context_flags(args: argparse.Namespace) -> str:
    """The flags the long-context and forced-passkey parts share."""
    return (
        f"--threads {args.threads} --context {args.context} --prefill-chunk {args.prefill_chunk} "
        f"--hot {args.hot} --warm {args.warm} --window {args.window} --score-every {args.score_every} "
        f"--depths {' '.join(f'{d:g}' for d in args.depths)} --settings {' '.join(args.settings)}"
    )


def forced_command(args: argparse.Namespace) -> str:
    """The command that reproduces the teacher-forced passkey table."""
    return f".venv/bin/python bench/cold_tier_quality.py forced-passkey {_long_context_flags(args)}"


@dataclass(frozen=True)
class ContextRow:
    """One setting's long-context figures."""

    setting: ContextSetting
    perplexity: PerplexityRow
    passkeys: list[PasskeyResult]
    device_bytes_per_token: float
    store_bytes_per_token: float
    demoted: CodecTally  # what the perplexity run's demotions encoded


@contextmanager
def counted_demotions() -> Iterator[CodecTally]:
    """Counts what the engine's demotions encode while the block runs: tokens, kept, payload bytes."""
    tally = CodecTally()
    original = cold_tier_module.encode_block

    def counting(
        keys: torch.Tensor, values: torch.Tensor, mass: torch.Tensor, settings: CodecSettings
    ) -> bytes:
        payload = original(keys, values, mass, settings)
        tally.payload_bytes += len(payload)
        tally.num_tokens += keys.shape[1]
        tally.num_kept += read_layout(payload).num_kept
        return payload

    cold_tier_module.encode_block = counting  # type: ignore[assignment]
    try:
        yield tally
    finally:
        cold_tier_module.encode_block = original


def kv_bytes(
    engine: LLMEngine, setting: ContextSetting, args: argparse.Namespace, demoted: CodecTally
) -> tuple[float, float]:
    """KV bytes per token of a `--context` sequence, BF16 hot (the serving dtype): device, kvstore.
    The window's pages and the cold payloads follow what the perplexity run's demotions kept."""
    cache = engine.runner.kv_cache
    bf16_token = cache.hot.bytes_per_token // 2  # the pool holds fp32 here
    tiers = setting.tiers
    if not tiers.enabled:
        return float(bf16_token), 0.0
    assert cache.warm is not None
    kept_share = demoted.num_kept / demoted.num_tokens if demoted.num_tokens else 1.0
    hot_tokens = BLOCK_SIZE + tiers.hot_tokens + (args.window * kept_share if setting.uses_cold else 0)
    warm_tokens = min(tiers.warm_tokens, args.context - hot_tokens)
    device = hot_tokens * bf16_token + warm_tokens * cache.warm.bytes_per_token
    if not setting.uses_cold:
        return device / args.context, 0.0
    cold_tokens = max(0, args.context - BLOCK_SIZE - tiers.hot_tokens - tiers.warm_tokens)
    config = engine.config
    num_blocks = cold_tokens // COLD_GROUP
    summaries = num_blocks * 2 * config.num_kv_heads * config.head_dim * 4  # key min and max, fp32
    shape = (config.num_layers, COLD_GROUP, config.num_kv_heads, config.head_dim)
    block_bytes = len(encode_block(torch.randn(shape), torch.randn(shape), torch.ones(COLD_GROUP)))
    if demoted.num_tokens:
        block_bytes = demoted.payload_bytes * COLD_GROUP / demoted.num_tokens
    return (device + summaries) / args.context, num_blocks * block_bytes / args.context


def long_context(args: argparse.Namespace) -> list[ContextRow]:
    """Every setting: perplexity, then the passkeys; the cold one against a real kvstore."""
    rows: list[ContextRow] = []
    reference: torch.Tensor | None = None
    rng = random.Random(args.seed)
    keys = [str(rng.randrange(10_000, 100_000)) for _ in args.depths]
    with tempfile.TemporaryDirectory(prefix="cold-tier-quality-") as tmp:
        redis = RedisServer(Path(tmp)).start()
        kvstore = KVStoreProcess(Path(tmp) / "kvstore", redis.url).start()
        os.environ[TOKEN_FILE_SETTING] = str(kvstore.service_token_path)  # call it as the engine does
        try:
            for setting in context_settings(args):
                engine = load_engine(setting, kvstore.target, args)
                ids = engine.tokenizer.encode(kv_quality.load_text()[: 8 * args.context])[: args.context]
                with counted_demotions() as demoted:
                    ppl, logprobs = perplexity(engine, setting, ids, args.tail, reference)
                    if engine.cold is not None:
                        engine.cold.tier.flush()
                reference = logprobs if reference is None else reference
                print(setting.name, ppl, flush=True)
                found = []
                for depth, key in zip(args.depths, keys, strict=True):
                    found.append(passkey(engine, setting, args, depth, key))
                    print(found[-1], flush=True)
                sizes = kv_bytes(engine, setting, args, demoted)
                rows.append(ContextRow(setting, ppl, found, *sizes, demoted))
                if args.out:  # a page after every setting: a long run stopped early keeps what it has
                    args.out.write_text(context_markdown(rows, args, environment()), encoding="utf-8")
                if engine.cold is not None:
                    engine.cold.tier.close()
        finally:
            kvstore.stop()
            redis.stop()
    return rows


# --- results --------------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """bench/cold_tier.py's date, commit and machine, with torch and Python."""
    env = cold_tier.environment()
    env["hardware"] += (
        f", torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )
    return env


def thresholds_markdown(
    rows: list[ThresholdRow], samples: list[ColdSample], args: argparse.Namespace, env: dict[str, str]
) -> str:
    """The thresholds results page."""
    entropies = [attention_entropy(s.mass) for s in samples]
    deciles = statistics.quantiles(entropies, n=10) if len(entropies) > 1 else entropies
    lines = [
        "# Cold tier: the entropy rule's thresholds, quality against codec time (SmolLM2-135M, CPU)",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}",
        f"- model: `{DEFAULT_MODEL}` (GGUF Q4_1 dequantized to fp32; KV fp32)",
        f"- text: the first {args.tokens} tokens of bench/kv_quality.py's text (Bierce, "
        "_The Devil's Dictionary_)",
        f"- emulation: chunks of {args.chunk}; positions 0..{BLOCK_SIZE - 1} exact (the sink block); every "
        f"{COLD_GROUP}-token group older than the last {args.recent} tokens goes through "
        "`encode_block` + `decode_block` once (group size 32, fp16 scales) and its dropped tokens "
        f"are masked; token mass = attention from the {args.history} queries before it went cold, "
        "summed over 30 layers and 9 heads; every cold block is attended (a window holding all of them)",
        f"- quality: over the {args.tokens - BLOCK_SIZE - COLD_GROUP - args.recent - 1} predictions "
        "whose context holds a cold block; KL(exact || setting) in nats per token",
        "- time: encode and decode ms per block ([30 layers, 32 tokens, 3 kv heads, 64 dims]), "
        f"vectorised codec on the CPU: the {len(entropies)} cold blocks of the exact run encoded by "
        f"every setting, settings interleaved, best of {args.repeats} per block, median over blocks; "
        "other work loaded the CPU, so read the ratios between rows",
        f"- cold-block entropy (deciles, exact run): {', '.join(f'{e:.3f}' for e in deciles)}",
        f"- reproduce: `{threshold_command(args)}`",
        "",
        "| setting (`SparsityRule`) | perplexity | mean KL | p99 KL | tokens kept | bytes/cold token "
        "| vs BF16 | encode ms | decode ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    bf16 = _bf16_bytes_per_token(samples)
    for r in rows:
        lines.append(f"{_codec_cells(r, bf16)} {_num(r.encode_ms, 2)} | {_num(r.decode_ms, 2)} |")
    return "\n".join(lines) + "\n"


def _num(value: float, digits: int) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"


def _bf16_bytes_per_token(samples: list[ColdSample]) -> int:
    """Keys and values of one token in BF16, all layers (a cold block's keys are `[L, G, KVH, D]`)."""
    layers, _, heads, dim = samples[0].keys.shape
    return 2 * 2 * layers * heads * dim


def _codec_cells(r: ThresholdRow, bf16_bytes_per_token: int) -> str:
    """The cells both codec tables share, from setting to the size against BF16, with a trailing `|`."""
    ratio = (
        "—" if math.isnan(r.bytes_per_cold_token) else f"{bf16_bytes_per_token / r.bytes_per_cold_token:.1f}x"
    )
    return (
        f"| {r.setting.name} | {r.perplexity:.3f} | {r.mean_kl:.5f} | {r.p99_kl:.4f} | "
        f"{r.kept_share:.0%} | {_num(r.bytes_per_cold_token, 1)} | {ratio} |"
    )


def pruning_markdown(
    rows: list[ThresholdRow], samples: list[ColdSample], args: argparse.Namespace, env: dict[str, str]
) -> str:
    """The pruning results page."""
    real = statistics.quantiles([attention_entropy(s.mass) for s in samples], n=10)
    proxy = statistics.quantiles([attention_entropy(key_norm_mass(s.keys)) for s in samples], n=10)
    lines = [
        "# Cold tier: what the engine's token pruning changes (SmolLM2-135M, CPU, emulation)",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}",
        f"- model: `{DEFAULT_MODEL}` (GGUF Q4_1 dequantized to fp32; KV fp32)",
        f"- text: the first {args.tokens} tokens of bench/kv_quality.py's text",
        f"- emulation: as the thresholds page (chunks of {args.chunk}, every {COLD_GROUP}-token group "
        f"older than the last {args.recent} tokens round-tripped through the codec once, dropped tokens "
        "masked, every cold block attended); the ranking mass is the attention from the "
        f"{args.history} queries before the group went cold, the engine's key-norm proxy "
        "(`key_norm_mass` over the group's exact keys), or random",
        f"- pages of {BLOCK_SIZE}: the kept count rounded up to whole KV blocks, as the engine stores "
        "it (`SparsityRule.keep_multiple`), so a pruned 32-token group keeps 16 or 32",
        f"- quality: over the {args.tokens - BLOCK_SIZE - COLD_GROUP - args.recent - 1} predictions "
        "whose context holds a cold block; KL(exact || setting) in nats per token",
        f"- cold-block entropy deciles, attention mass: {', '.join(f'{e:.3f}' for e in real)}",
        f"- cold-block entropy deciles, key-norm proxy: {', '.join(f'{e:.3f}' for e in proxy)}",
        f"- reproduce: `{pruning_command(args)}`",
        "",
        "| setting | perplexity | mean KL | p99 KL | tokens kept | bytes/cold token | vs BF16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    bf16 = _bf16_bytes_per_token(samples)
    lines += [_codec_cells(r, bf16) for r in rows]
    return "\n".join(lines) + "\n"


def pruning_command(args: argparse.Namespace) -> str:
    """The command that reproduces the pruning page."""
    return (
        f".venv/bin/python bench/cold_tier_quality.py pruning --tokens {args.tokens} --chunk {args.chunk} "
        f"--threads {args.threads} --recent {args.recent} --history {args.history}"
    )


def threshold_command(args: argparse.Namespace) -> str:
    """The command that reproduces the matrix."""
    return (
        f".venv/bin/python bench/cold_tier_quality.py thresholds --tokens {args.tokens} "
        f"--chunk {args.chunk} --repeats {args.repeats} --threads {args.threads} --recent {args.recent} "
        f"--history {args.history} --cuts {' '.join(map(str, args.cuts))} "
        f"--keeps {' '.join(map(str, args.keeps))}"
    )


def context_markdown(rows: list[ContextRow], args: argparse.Namespace, env: dict[str, str]) -> str:
    """The long-context results page."""
    lines = [
        f"# Cold tier: quality at {args.context} tokens of context (SmolLM2-135M, CPU)",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- hardware: {env['hardware']}",
        f"- model: `{DEFAULT_MODEL}` (GGUF Q4_1 dequantized to fp32), the real engine (`LLMEngine`), "
        f"prefill chunks of {args.prefill_chunk} tokens; one redis-server and one kvstore process on "
        "loopback for the cold setting",
        f"- tiers: sink 4, hot {args.hot}, warm {args.warm} (INT4, group {COLD_GROUP}); cold: warm "
        f"overflow demoted INT2 (codec defaults), auxiliary window {args.window} tokens scored every "
        f"{args.score_every} decode step(s)",
        f"- perplexity: the first {args.context - args.tail} tokens of bench/kv_quality.py's text as "
        f"the prompt, then {args.tail} teacher-forced decode steps; KL(full || setting) over those steps",
        f"- passkey: a 5-digit key at depths {', '.join(f'{d:g}' for d in args.depths)} of a "
        f"{args.context}-token filler prompt; {args.answer_tokens} greedy tokens; found = the key "
        "appears in the answer",
        "- KV bytes/token: for one sequence of the full context, hot tokens counted in BF16 (the "
        "serving dtype; this run held fp32); device = sink + hot + window in BF16 (the window's "
        "pages scaled by the share of tokens the demotions kept), warm INT4, cold summary keys; "
        "kvstore = INT2 payloads of the cold blocks, at the bytes per token the perplexity run's "
        "demotions wrote",
        "- pruned: `THERMOCLINE_ENGINE_COLD_PRUNE_TOKENS` on (key-norm proxy, the codec's default "
        f"rule, kept tokens rounded up to whole {BLOCK_SIZE}-token pages)",
        f"- reproduce: `{context_command(args)}`",
        "",
        "| setting | perplexity | mean KL | passkeys found | digits right | device KV bytes/token "
        "| kvstore bytes/token | cold tokens kept | window loads | blocks demoted "
        "| seconds (perplexity run) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p = r.perplexity
        found = sum(k.found for k in r.passkeys)
        digits = sum(k.digits_right for k in r.passkeys)
        lines.append(
            f"| {r.setting.name} | {p.perplexity:.3f} | {p.mean_kl:.4f} | {found}/{len(r.passkeys)} | "
            f"{digits}/{5 * len(r.passkeys)} | {r.device_bytes_per_token:,.0f} | "
            f"{r.store_bytes_per_token:,.0f} | {_kept(r.demoted)} | {p.window_loads} | {p.blocks_demoted} | "
            f"{p.seconds:.0f} |"
        )
    lines += ["", "| setting | depth | key | answer |", "| --- | ---: | --- | --- |"]
    for r in rows:
        for k in r.passkeys:
            answer = k.answer.replace("\n", " ⏎ ")  # a line break would end the table row
            lines.append(f"| {r.setting.name} | {k.depth:g} | {k.key} | `{answer}` |")
    return "\n".join(lines) + "\n"


def _kept(tally: CodecTally) -> str:
    return f"{tally.num_kept / tally.num_tokens:.0%}" if tally.num_tokens else "—"


def context_command(args: argparse.Namespace) -> str:
    """The command that reproduces the long-context table."""
    return (
        f".venv/bin/python bench/cold_tier_quality.py long-context {_long_context_flags(args)} "
        f"--tail {args.tail} --answer-tokens {args.answer_tokens}"
    )


def main() -> None:
    """Run one part and print (or write) its results page."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parts = parser.add_subparsers(dest="part", required=True)
    rule = parts.add_parser("thresholds", help="the entropy rule's matrix (emulation)")
    prune = parts.add_parser("pruning", help="the engine's pruning: pages, key-norm proxy (emulation)")
    for sub in (rule, prune):
        sub.add_argument("--tokens", type=int, default=1536)
        sub.add_argument(
            "--chunk", type=int, default=64, help="tokens per forward (a chunk sees itself exactly)"
        )
        sub.add_argument("--recent", type=int, default=256, help="exact tokens at the end (hot + warm)")
        sub.add_argument(
            "--history", type=int, default=64, help="queries whose attention sets a token's mass"
        )
    rule.add_argument("--repeats", type=int, default=3, help="codec timing: best of this many per block")
    prune.set_defaults(repeats=0)
    rule.add_argument("--cuts", type=float, nargs="+", default=[0.93, 0.97, 0.99], help="high_entropy")
    rule.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25, 0.125], help="mid_keep_ratio")
    context = parts.add_parser("long-context", help="perplexity and passkey on the real engine")
    forced = parts.add_parser("forced-passkey", help="the passkey with the question teacher-forced")
    for sub in (context, forced):
        sub.add_argument("--context", type=int, default=4096)
        sub.add_argument("--prefill-chunk", type=int, default=512)
        sub.add_argument("--hot", type=int, default=256)
        sub.add_argument("--warm", type=int, default=512)
        sub.add_argument("--window", type=int, default=512)
        sub.add_argument("--score-every", type=int, default=1)
        sub.add_argument("--score-layer", type=int, default=-1, help="-1: middle layer")
        sub.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
        sub.add_argument("--kv-mb", type=int, default=1024)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument(
            "--settings", nargs="+", choices=CONTEXT_SETTINGS, default=["full", "sliding", "cold"],
            help="pruned: the cold setting with THERMOCLINE_ENGINE_COLD_PRUNE_TOKENS on",
        )  # fmt: skip
    context.add_argument("--tail", type=int, default=128, help="teacher-forced decode steps scored")
    context.add_argument("--answer-tokens", type=int, default=12)
    for sub in (rule, prune, context, forced):
        sub.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
        sub.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    if args.part in ("thresholds", "pruning"):
        engine = LLMEngine.load(
            DEFAULT_MODEL, device="cpu", dtype="float32", max_batch_size=1, max_seq_len=args.tokens,
            progress=False,
        )  # fmt: skip
        if args.part == "pruning":
            markdown = pruning_markdown(*thresholds(engine, args, pruning_settings()), args, env)
        else:
            rows, samples = thresholds(engine, args, threshold_settings(args.cuts, args.keeps))
            markdown = thresholds_markdown(rows, samples, args, env)
    elif args.part == "forced-passkey":
        markdown = forced_markdown(forced_passkeys(args), args)
    else:
        markdown = context_markdown(long_context(args), args, env)
    print(markdown)
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")


if __name__ == "__main__":
    main()
