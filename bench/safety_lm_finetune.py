"""SmolLM2-135M-Instruct's first blocks, fine-tuned end to end as the harm classifier, held out
by source (issue 13, point 2: the bigger encoder, fine-tuned).

Three steps, because the GPU machine has no network and carries at most 64 MiB:

    .venv/bin/python bench/safety_lm_finetune.py export DIR            # this machine: data + trunk
    python bench/safety_lm_finetune.py run DIR --out OUT               # the GPU (or a CPU, slowly)
    .venv/bin/python bench/safety_lm_finetune.py compare DIR OUT       # this machine: the table

`export` writes the texts of tools/safety_data.py's by-source split as SmolLM2 token ids (each
text's canonical form as a user turn of SmolLM2's chat format, cut to `--max-tokens`), and the
model's embedding rows for the tokens used plus its first `--blocks` blocks as the wheel's GGUF
stores them (Q8_0 / Q4_1 bytes, verified by sha256 through services/engine/model/registry.py).
`run` rebuilds that trunk, trains each variant (blocks, pooling, LoRA rank; rank 0 trains the
head alone on the frozen trunk) on the training split only, as the shipped prompt head is
trained (softmax over benign + 6 categories, class-balanced), and writes every calibration and
test text's scores. `compare` sets each variant's threshold by the gate's calibration rule
(1% of the pooled calibration prompts and of each ordinary source, 3% of each sensitive source)
and reads the held-out sources beside the shipped gate, screened on this machine exactly as the
service screens (bench/safety_eval.py's `judge`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lm_blocks import (  # noqa: E402
    FRAME_HEAD,
    FRAME_TAIL,
    PROJECTIONS,
    LlamaBlocks,
    LlamaShape,
    padded,
    unpermute_rope,
)

NUM_CLASSES = 7  # benign + tools/safety_data.py CATEGORIES, in label_index order
LABELS = ("benign", "violence", "self_harm", "sexual", "hate", "cyber", "crime")  # label_index order
# The calibration rule of tools/calibrate_safety_gate.py, for one harm score.
SENSITIVE_LIMIT = 0.03
ORDINARY_LIMIT = 0.01
# (blocks, pooling, LoRA rank); rank 0: the trunk frozen, the head alone trained.
VARIANTS = (
    (8, "last", 0),
    (8, "mean", 0),
    (8, "last", 16),
    (8, "mean", 16),
    (6, "last", 16),
    (12, "last", 16),
    (12, "mean", 16),
)
Q8_0, Q4_1 = 8, 3  # ggml type numbers


# ---------------------------------------------------------------- export (this machine)


def eval_rows(wheels_dir: Path) -> tuple[list, list[tuple[str, object]]]:
    """(training examples, [(role, example)] for calibration and test), by source."""
    from bench.safety_eval import HeldOut
    from tools.calibrate_safety_gate import SENSITIVE
    from tools.finetune_safety_encoder import training_examples
    from tools.safety_data import (
        BENIGN,
        CALIB,
        CALIBRATION_FILES,
        Example,
        fetch_wheels,
        load_benign_outputs,
        load_examples,
        read_data_source,
    )

    wheels = fetch_wheels(wheels_dir)
    examples = load_examples(wheels)
    train = training_examples(wheels)
    held = HeldOut.of(examples, load_benign_outputs(wheels, examples), 400)
    rows: list[tuple[str, object]] = []
    for name in CALIBRATION_FILES:
        role = "calib_sensitive" if name in SENSITIVE else "calib"
        rows += [(role, Example(t, BENIGN, "prompt", name)) for t in read_data_source(name)]
    rows += [("calib_split", e) for e in examples if e.split == CALIB and e.kind == "prompt"]
    rows += [("test", e) for e in held.prompts]
    rows += [("test_output", e) for e in held.harmful_outputs + held.benign_outputs + held.pyrit_safe_answers]
    for name in ("jailbreak_inthewild", "benign_bipia_emails"):
        label = BENIGN if name.startswith("benign") else "jailbreak"
        rows += [("test_extra", Example(t, label, "prompt", name)) for t in read_data_source(name)]
    return train, rows


def export(directory: Path, wheels_dir: Path, num_blocks: int, max_tokens: int) -> None:
    """Writes `directory`/{meta.json, ids.npy, offsets.npy, trunk.npz}."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from services.engine.model.registry import resolve_model, sha256_of
    from services.safety.normalizer import canonical
    from tools.safety_data import label_index

    path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    head, tail = tokenizer.encode(FRAME_HEAD), tokenizer.encode(FRAME_TAIL)
    train, evaluated = eval_rows(wheels_dir)
    rows = [("train", e) for e in train] + evaluated
    body = max_tokens - len(head) - len(tail)
    token_rows = [head + tokenizer.encode(canonical(e.text))[:body] + tail for _, e in rows]
    used = sorted({t for row in token_rows for t in row})
    remap = {t: i for i, t in enumerate(used)}
    ids = np.array([remap[t] for row in token_rows for t in row], dtype=np.uint16)
    offsets = np.cumsum([0] + [len(r) for r in token_rows]).astype(np.int64)
    reader = GGUFReader(str(path))
    kept = {"token_embd.weight"} | {
        f"blk.{b}.{n}.weight"
        for b in range(num_blocks)
        for n in [*PROJECTIONS.values(), "attn_norm", "ffn_norm"]
    }
    arrays: dict[str, np.ndarray] = {"vocab": np.array(used, dtype=np.int64)}
    for tensor in reader.tensors:
        if tensor.name not in kept:
            continue
        data = np.asarray(tensor.data)
        if tensor.name == "token_embd.weight":
            if int(tensor.tensor_type) != Q8_0:
                raise ValueError(f"token_embd is {tensor.tensor_type.name}, expected Q8_0")
            data = data.reshape(int(tensor.shape[1]), -1)[used]  # rows of the used tokens
        arrays[tensor.name] = data.copy()
        arrays[tensor.name + ".type"] = np.array(int(tensor.tensor_type))
        arrays[tensor.name + ".shape"] = np.array([int(d) for d in reversed(tensor.shape)])
    np.savez(directory / "trunk.npz", **arrays)
    np.save(directory / "ids.npy", ids)
    np.save(directory / "offsets.npy", offsets)
    meta = {
        "model": {"file": path.name, "sha256": sha256_of(path)},
        "config": {
            "hidden": 576,
            "heads": 9,
            "kv_heads": 3,
            "head_dim": 64,
            "intermediate": 1536,
            "rope_theta": float(reader.fields["llama.rope.freq_base"].contents()),
            "eps": float(reader.fields["llama.attention.layer_norm_rms_epsilon"].contents()),
            "blocks": num_blocks,
        },
        "frame": {"head": len(head), "tail": len(tail)},
        "max_tokens": max_tokens,
        "rows": [
            {
                "role": role,
                "source": e.source,
                "kind": e.kind,
                "label": e.label,
                "y": label_index(e.label) if e.label in LABELS else -1,
                "sha": hashlib.sha256(e.text.encode()).hexdigest()[:16],
                "chars": len(e.text),
            }
            for role, e in rows
        ],
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    size = sum(f.stat().st_size for f in directory.iterdir())
    print(f"{len(rows)} texts ({len(train)} training), {len(used)} token types, {ids.size} tokens; "
          f"{size / 2**20:.1f} MiB in {directory}")  # fmt: skip


# ---------------------------------------------------------------- the trunk (any machine)


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF Q8_0 or Q4_1 blocks of 32, or F32, as an fp32 tensor of `shape` (rows innermost)."""
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    if qtype == 0:  # F32
        return data.view(torch.float32).reshape(shape).clone()
    if qtype == Q8_0:
        blocks = data.reshape(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        values = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (values * scale).reshape(shape)
    if qtype == Q4_1:
        blocks = data.reshape(-1, 20)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        low = blocks[:, 2:4].contiguous().view(torch.float16).float()
        nibbles = blocks[:, 4:].long()
        values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=1).float()
        return (values * scale + low).reshape(shape)
    raise ValueError(f"GGUF type {qtype} is not handled")


def trunk_tensors(
    arrays: dict[str, np.ndarray], num_blocks: int, shape: LlamaShape
) -> dict[str, torch.Tensor]:
    """The exported tensors as services/safety/lm_encoder.py's LlamaBlocks takes them."""

    def tensor(name: str) -> torch.Tensor:
        dims = tuple(int(d) for d in arrays[name + ".shape"])
        if name == "token_embd.weight":
            dims = (len(arrays["vocab"]), dims[1])
        return dequantize(arrays[name], int(arrays[name + ".type"]), dims)

    out = {"embed": tensor("token_embd.weight")}
    for b in range(num_blocks):
        out |= {f"{b}.{n}": tensor(f"blk.{b}.{n}.weight") for n in ("attn_norm", "ffn_norm")}
        for short, gguf_name in PROJECTIONS.items():
            weight = tensor(f"blk.{b}.{gguf_name}.weight")
            if short in ("q", "k"):
                weight = unpermute_rope(weight, shape.heads if short == "q" else shape.kv_heads)
            out[f"{b}.{short}"] = weight
    return out


def llama_shape(config: dict) -> LlamaShape:
    return LlamaShape(
        config["hidden"],
        config["heads"],
        config["kv_heads"],
        config["head_dim"],
        config["rope_theta"],
        config["eps"],
    )


class Classifier(torch.nn.Module):
    """Trunk, pooling (the answer's first position or the mean over the user text), RMSNorm, head."""

    def __init__(self, trunk: LlamaBlocks, pool: str, frame: dict[str, int]) -> None:
        super().__init__()
        self.trunk, self.pool, self.frame = trunk, pool, frame
        hidden = trunk.shape.hidden
        self.norm_weight = torch.nn.Parameter(torch.ones(hidden))
        self.head = torch.nn.Linear(hidden, NUM_CLASSES)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        states = self.trunk(ids).float()
        if self.pool == "last":
            pooled = states[torch.arange(len(ids), device=ids.device), lengths - 1]
        else:
            positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
            inside = (positions >= self.frame["head"]) & (positions < (lengths - self.frame["tail"])[:, None])
            pooled = (states * inside[..., None]).sum(1) / inside.sum(1, keepdim=True).clamp(min=1)
        pooled = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm_weight
        return self.head(pooled)


# ---------------------------------------------------------------- run (the GPU)


def batches(
    lengths: list[int], indices: list[int], tokens: int, rng: random.Random | None
) -> list[list[int]]:
    """Indices in batches of similar length, at most `tokens` padded tokens each."""
    order = sorted(indices, key=lambda i: (lengths[i], rng.random() if rng else i))
    out, current, width = [], [], 0
    for i in order:
        width_if = max(width, lengths[i])
        if current and width_if * (len(current) + 1) > tokens:
            out.append(current)
            current, width_if = [], lengths[i]
        current.append(i)
        width = width_if
    if current:
        out.append(current)
    if rng:
        rng.shuffle(out)
    return out


def run(
    directory: Path, out: Path, epochs: int, only: list[str] | None, batch_tokens: int, smoke: bool
) -> None:
    """Trains every variant on the training rows, writes `out`/scores.pt and prints a summary."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = json.loads((directory / "meta.json").read_text())
    ids, offsets = np.load(directory / "ids.npy"), np.load(directory / "offsets.npy")
    rows = [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    lengths = [len(r) for r in rows]
    arrays = dict(np.load(directory / "trunk.npz"))
    info = meta["rows"]
    train = [i for i, r in enumerate(info) if r["role"] == "train" and r["y"] >= 0]
    scored = [i for i, r in enumerate(info) if r["role"] != "train"]
    if smoke:  # a few rows of each, to check the code path on a CPU
        train, scored = random.Random(0).sample(train, 64), random.Random(0).sample(scored, 600)
    labels = torch.tensor([info[i]["y"] for i in range(len(info))], device=device)
    counts = torch.bincount(labels[train], minlength=NUM_CLASSES).float().clamp(min=1)
    class_weight = counts.sum() / (NUM_CLASSES * counts)
    results: dict[str, object] = {"rows": [info[i]["sha"] for i in scored], "variants": {}}
    print(f"device {device}, {len(train)} training rows, {len(scored)} scored; classes {counts.tolist()}")
    for blocks, pool, rank in VARIANTS:
        name = f"{blocks} blocks, {pool}, " + (f"LoRA r{rank}" if rank else "frozen")
        if (only and name not in only) or blocks > meta["config"]["blocks"]:
            continue
        torch.manual_seed(0)
        start = time.monotonic()
        shape = llama_shape(meta["config"])
        trunk = LlamaBlocks(shape, trunk_tensors(arrays, blocks, shape), blocks, dtype, rank, 2.0 * rank)
        model = Classifier(trunk.to_device(device), pool, meta["frame"]).to(device)
        groups = [{"params": [model.norm_weight, *model.head.parameters()], "lr": 2e-3}]
        if rank:
            groups.append({"params": list(model.trunk.lora.parameters()), "lr": 5e-4})
        optimizer = torch.optim.AdamW(groups, weight_decay=0.01)
        rng = random.Random(0)
        plan = [batches(lengths, train, batch_tokens, rng) for _ in range(epochs)]
        total = sum(map(len, plan))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s, n=total: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / n))
        )
        model.train()
        step, losses = 0, []
        for epoch, epoch_batches in enumerate(plan):
            for batch in epoch_batches:
                x, n = (t.to(device) for t in padded([rows[i] for i in batch]))
                with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                    logits = model(x, n)
                loss = F.cross_entropy(logits.float(), labels[batch], weight=class_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
                step += 1
            print(f"  {name}: epoch {epoch} loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
        trained = time.monotonic() - start
        model.eval()
        probs = torch.zeros(len(info), NUM_CLASSES)
        with torch.inference_mode():
            for batch in batches(lengths, scored, batch_tokens * 4, None):
                x, n = (t.to(device) for t in padded([rows[i] for i in batch]))
                with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                    probs[batch] = model(x, n).float().softmax(-1).cpu()
        results["variants"][name] = {
            "probs": probs[scored].half(),
            "train_seconds": round(trained, 1),
            "steps": step,
            "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        }
        harm = 1 - probs[scored, 0]
        print(f"{name}: {step} steps in {trained:.0f} s; " + quick_summary(info, scored, harm), flush=True)
        del model, optimizer
    results["settings"] = {
        "epochs": epochs,
        "batch_tokens": batch_tokens,
        "device": str(device),
        "dtype": str(dtype),
    }
    torch.save(results, out / "scores.pt")


def quick_summary(info: list[dict], scored: list[int], harm: torch.Tensor) -> str:
    """Held-out recall and FPR at the calibration rule, for the log."""
    threshold = calibrated_threshold([info[i] for i in scored], harm)
    role = [info[i]["role"] for i in scored]
    test_harm = [k for k, i in enumerate(scored) if role[k] == "test" and info[i]["y"] != 0]
    test_benign = [k for k, i in enumerate(scored) if role[k] == "test" and info[i]["y"] == 0]
    recall = float((harm[test_harm] >= threshold).float().mean())
    fpr = float((harm[test_benign] >= threshold).float().mean())
    return f"threshold {threshold:.4f}, held-out recall {recall:.3f}, held-out FPR {fpr:.3f}"


def calibrated_threshold(info: list[dict], harm: torch.Tensor) -> float:
    """The lowest score threshold that keeps the pooled calibration prompts and each ordinary
    source at most 1% FPR and each sensitive source at most 3% (the gate's rule, one score)."""
    by_source: dict[str, list[int]] = {}
    for k, r in enumerate(info):
        if r["role"] in ("calib", "calib_sensitive"):
            by_source.setdefault(r["source"], []).append(k)
    pooled = [k for ks in by_source.values() for k in ks]

    def above(indices: list[int], limit: float) -> float:
        values = harm[indices].sort(descending=True).values
        allowed = math.floor(limit * len(values))
        return float(values[allowed]) + 1e-6  # the (allowed+1)-th highest must be below

    sensitive = {info[k]["source"] for k in pooled if info[k]["role"] == "calib_sensitive"}
    limits = [above(pooled, ORDINARY_LIMIT)] + [
        above(ks, SENSITIVE_LIMIT if s in sensitive else ORDINARY_LIMIT) for s, ks in by_source.items()
    ]
    return max(limits)


# ---------------------------------------------------------------- compare (this machine)


def shipped_margins(directory: Path, wheels_dir: Path) -> dict[str, torch.Tensor]:
    """The shipped gate's harm margin and whole-screen verdict for every scored text, screened as
    the service screens it (prompts against the prompt thresholds, outputs against the output
    ones); cached beside the export, by the gate's sha256."""
    from bench.safety_eval import judge
    from services.common.gate_file import load_gate
    from services.safety.classifier import TextClassifier
    from services.safety.config import DEFAULT_GATE, DEFAULT_MAX_WINDOWS
    from services.safety.embedder import MiniLMEmbedder

    gate = load_gate(DEFAULT_GATE)
    cache = directory / f"shipped-{gate.sha256[:12]}.pt"
    if cache.exists():
        return torch.load(cache)
    _, rows = eval_rows(wheels_dir)
    classifier = TextClassifier(gate, MiniLMEmbedder.for_gate(gate), max_windows=DEFAULT_MAX_WINDOWS)
    margin, screen = torch.full((len(rows),), float("nan")), torch.zeros(len(rows), dtype=torch.bool)
    for kind in ("prompt", "output"):
        chosen = [k for k, (role, _) in enumerate(rows) if role.startswith("test") and
                  (role == "test_output") == (kind == "output")]  # fmt: skip
        judged = judge(classifier, [rows[k][1] for k in chosen], kind)
        margin[chosen] = judged.margins
        screen[chosen] = torch.tensor(judged.screen)
    out = {"margin": margin, "screen": screen, "gate": gate.version, "sha": [
        hashlib.sha256(e.text.encode()).hexdigest()[:16] for _, e in rows]}  # fmt: skip
    torch.save(out, cache)
    return out


def oracle_recall(positive: torch.Tensor, negative: torch.Tensor, fpr: float) -> float:
    """Recall with the threshold where the negatives give `fpr` (chosen on the test set)."""
    threshold = negative.sort(descending=True).values[math.floor(fpr * len(negative))]
    return float((positive > threshold).float().mean())


def rate(mask: torch.Tensor) -> str:
    return f"{100 * float(mask.float().mean()):.1f}% ({int(mask.sum())}/{len(mask)})"


def compare(directory: Path, out: Path, wheels_dir: Path) -> None:
    """Prints the markdown tables: each variant at the calibration rule, beside the shipped gate."""
    from bench.safety_eval import roc_auc

    meta = json.loads((directory / "meta.json").read_text())
    results = torch.load(out / "scores.pt")
    info = [r for r in meta["rows"] if r["role"] != "train"]
    if [r["sha"] for r in info] != results["rows"]:
        raise ValueError("scores.pt was written for another export")
    shipped = shipped_margins(directory, wheels_dir)
    offset = len(meta["rows"]) - len(info)
    if shipped["sha"] != [r["sha"] for r in meta["rows"][offset:]]:
        raise ValueError(f"the cached shipped-gate scores in {directory} were written for another export")
    role = [r["role"] for r in info]
    source = [r["source"] for r in info]

    def where(keep) -> torch.Tensor:
        return torch.tensor([k for k, r in enumerate(info) if keep(r)], dtype=torch.long)

    def of_source(name: str, is_harmful: bool) -> torch.Tensor:
        return where(lambda r: r["role"] == "test" and r["source"] == name and (r["y"] != 0) == is_harmful)

    harmful = where(lambda r: r["role"] == "test" and r["y"] != 0)
    benign = where(lambda r: r["role"] == "test" and r["y"] == 0)
    per_source = sorted({(source[k], info[k]["y"] != 0) for k in range(len(info)) if role[k] == "test"},
                        key=lambda s: (not s[1], s[0]))  # fmt: skip
    extra = ("jailbreak_inthewild", "benign_bipia_emails")
    out_harm = where(lambda r: r["role"] == "test_output" and r["y"] != 0)
    out_replies = where(lambda r: r["role"] == "test_output" and r["source"] == "sharegpt/replies")
    output_calib = where(lambda r: r["role"].startswith("calib") and r["source"] in
                         ("benign_medquad_long", "benign_project_docs", "benign_stdlib_code"))  # fmt: skip

    def column(score: torch.Tensor, block: torch.Tensor, out_block: torch.Tensor) -> dict[str, str]:
        """One screen's figures: its prompt `block` and output `out_block` decisions, and `score`
        (higher is more harmful) for the AUC and the oracle recalls."""
        col = {
            "recall": rate(block[harmful]),
            "FPR": rate(block[benign]),
            "AUC": f"{roc_auc(score[harmful], score[benign]):.3f}",
            "oracle 1%": f"{100 * oracle_recall(score[harmful], score[benign], 0.01):.1f}%",
            "oracle 5%": f"{100 * oracle_recall(score[harmful], score[benign], 0.05):.1f}%",
        }
        col |= {name: rate(block[of_source(name, is_harmful)]) for name, is_harmful in per_source}
        col |= {name: rate(block[where(lambda r, n=name: r["source"] == n)]) for name in extra}
        return col | {
            "outputs: PyRIT harmful (recall)": rate(out_block[out_harm]),
            "outputs: ShareGPT replies (FPR)": rate(out_block[out_replies]),
            "outputs AUC": f"{roc_auc(score[out_harm], score[out_replies]):.3f}",
        }

    margin = shipped["margin"]
    ship_block = margin >= 0  # the harm categories' own decision, on prompts and on outputs alike
    columns = {
        f"shipped gate {shipped['gate']} (MiniLM, LoRA, windows)": {
            "threshold": "its calibrated per-category thresholds"
        }
        | column(margin, ship_block, ship_block)
    }
    for name, variant in results["variants"].items():
        harm = 1 - variant["probs"][:, 0].float()
        threshold = calibrated_threshold(info, harm)
        block = harm >= threshold
        ranked = harm[output_calib].sort(descending=True).values
        out_threshold = float(ranked[math.floor(0.01 * len(ranked))]) + 1e-6
        columns[name] = (
            {"threshold": f"{threshold:.4f}"}
            | column(harm, block, harm >= out_threshold)
            | {"training": f"{variant['steps']} steps, {variant['train_seconds']} s"}
        )
        either = block | ship_block  # the shipped harm decision or this one
        columns[name + " OR shipped"] = {
            "recall": rate(either[harmful]),
            "FPR": rate(either[benign]),
            **{src: rate(either[of_source(src, h)]) for src, h in per_source},
        }
    names = list(columns)
    keys = list(dict.fromkeys(k for c in columns.values() for k in c))
    print("| measure | " + " | ".join(names) + " |")
    print("| --- | " + " | ".join("---:" for _ in names) + " |")
    for key in keys:
        print(f"| {key} | " + " | ".join(columns[n].get(key, "-") for n in names) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("directory", type=Path)
    p.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256)
    p = sub.add_parser("run")
    p.add_argument("directory", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--smoke", action="store_true", help="a few rows only (checks the code on a CPU)")
    p = sub.add_parser("compare")
    p.add_argument("directory", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    args = parser.parse_args()
    if args.command == "compare":
        compare(args.directory, args.out, args.wheels)
    elif args.command == "export":
        args.directory.mkdir(parents=True, exist_ok=True)
        export(args.directory, args.wheels, args.blocks, args.max_tokens)
    elif args.command == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.directory, args.out, args.epochs, args.only, args.batch_tokens, args.smoke)


if __name__ == "__main__":
    main()
