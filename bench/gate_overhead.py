"""Cost of the in-loop safety gate per decode step: the same decode with the gate on and off.

    .venv/bin/python bench/gate_overhead.py                 # SmolLM2-135M-Instruct, CPU, batch 1 and 8
    python3 bench/gate_overhead.py --model random:smollm2 --device cuda --out $OUT/gate_overhead.md

Two readings, both on the engine's own code:
- decode ms/step: whole decode runs (greedy, EOS ignored) with the gate installed and not,
  interleaved (off/on, then on/off, ...) so drift hits both; the median over the repeats;
- fetch us: the end of a step in isolation, `sampled ids -> host` against `gate flags + ids -> host`
  (llm_engine.PendingFetch), the median of many calls; its difference is the gate's whole added work.
The gate runs the shipped gate's engine head when it fits the model's hidden size (SmolLM2),
otherwise a random head of the same form; its thresholds are set to 1 so it never fires and both
modes decode the same tokens (the work per step does not depend on the thresholds).
`random:smollm2` / `random:llama-1b` build random-weight checkpoints of those shapes (no network).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.gate_file import ENGINE_HEAD, HeadWeights, load_gate  # noqa: E402
from services.engine.gate.gate_loader import DEFAULT_GATE_FILE  # noqa: E402
from services.engine.gate.safety_gate import GateReport, GateStatus, InLoopGate  # noqa: E402
from services.engine.llm_engine import LLMEngine, PendingFetch  # noqa: E402
from services.engine.scheduling.sampling_params import SamplingParams  # noqa: E402
from services.engine.scheduling.sequence import StreamEvent  # noqa: E402

RANDOM_SHAPES = {
    "smollm2": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
    "llama-1b": {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
}  # fmt: skip


def random_checkpoint(shape: str, path: Path) -> Path:
    """An HF Llama directory with random bf16 weights in a named shape, and a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = RANDOM_SHAPES[shape]
    config = LlamaConfig(**kwargs, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(int(kwargs["vocab_size"]))}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    return path


def never_firing_gate(hidden_size: int, device: torch.device) -> tuple[InLoopGate, str]:
    """The shipped engine head when it fits, else a random one; thresholds 1 (the limit is +inf)."""
    shipped = load_gate(DEFAULT_GATE_FILE).head_weights(ENGINE_HEAD)
    num_classes, shipped_hidden_size = shipped.weight.shape  # [C + 1, H]
    if hidden_size == shipped_hidden_size:
        weight, bias, source = shipped.weight, shipped.bias, "shipped engine head (thresholds set to 1)"
    else:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(num_classes, hidden_size, generator=generator)
        bias, source = torch.zeros(num_classes), "random head of the shipped form (thresholds 1)"
    head = HeadWeights(weight, bias, torch.ones(num_classes - 1))
    categories = tuple(f"c{i}" for i in range(num_classes - 1))
    return InLoopGate(head, categories, "blocked", device), f"{source}; {len(categories)} categories"


class TokenCounter:
    """An on_event callback that counts a request's tokens."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.is_done = False

    def __call__(self, event: StreamEvent) -> None:
        self.num_tokens += len(event.token_ids)
        self.is_done = event.finished


def decode_ms_per_step(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Runs the batch to the end on this thread; ms per step once every request has its first token."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    counters = [TokenCounter() for _ in prompts]
    for prompt, counter in zip(prompts, counters, strict=True):
        engine.submit(prompt, params, counter)
    while not all(c.num_tokens for c in counters):  # prefill (possibly in chunks)
        engine.step()
    start, num_steps = time.perf_counter(), 0
    while not all(c.is_done for c in counters):  # decode: each step ends in the host sync
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start) * 1e3 / num_steps


def fetch_us(gate: InLoopGate | None, batch: int, engine: LLMEngine, num_calls: int) -> float:
    """Median us of the step's last part, ids (and the gate's flags) to the host, over many calls."""
    device, hidden_size = engine.runner.device, engine.config.hidden_size
    dtype = next(engine.runner.model.parameters()).dtype
    token_ids = torch.randint(0, 100, (batch,), device=device)
    hidden = torch.randn(batch, hidden_size, device=device, dtype=dtype)  # [B, E] like the step's
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        PendingFetch(token_ids, gate.flags(hidden) if gate else None).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times[num_calls // 10 :]) * 1e6


def measure(engine: LLMEngine, gate: InLoopGate, args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Interleaved decode runs with the gate off and on, and the isolated fetch, for one batch size."""
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.config.vocab_size
    prompts = torch.randint(2, vocab, (batch, args.prompt_tokens), generator=generator).tolist()
    report = GateReport(GateStatus.UNVERIFIED, is_active=True)
    modes = {"off": (None, GateReport(GateStatus.ABSENT)), "on": (gate, report)}
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up both modes and is dropped
        for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
            engine.set_safety_gate(*modes[mode])
            ms = decode_ms_per_step(engine, prompts, args.new_tokens)
            if repeat:
                runs[mode].append(ms)
    engine.set_safety_gate(None, GateReport(GateStatus.ABSENT))
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    fetch_off = fetch_us(None, batch, engine, args.fetch_calls)
    fetch_on = fetch_us(gate, batch, engine, args.fetch_calls)
    return {
        "off_ms": off, "on_ms": on, "delta_pct": (on - off) / off * 100,
        "fetch_off_us": fetch_off, "fetch_on_us": fetch_on,
        "fetch_pct": (fetch_on - fetch_off) / (off * 1e3) * 100,
        "spread_off": _spread(runs["off"]), "spread_on": _spread(runs["on"]),
    }  # fmt: skip


def _spread(values: list[float]) -> float:
    """(max - min) / median, in percent: how noisy the repeats were."""
    return (max(values) - min(values)) / statistics.median(values) * 100


def hardware(device: torch.device) -> str:
    """The processor or GPU, in words."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    threads = torch.get_num_threads()
    load = os.getloadavg()[0]
    return f"{platform.processor() or platform.machine()}, torch threads {threads}, 1-min load {load:.1f}"


def commit() -> str:
    """The checkout's short commit, marked when the tree has changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO)
    except OSError:
        return "unknown (no git)"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def render(
    args: argparse.Namespace, engine: LLMEngine, source: str, rows: dict[int, dict[str, float]], code: str
) -> str:
    """The results as markdown."""
    now = dt.datetime.now(dt.UTC)
    lines = [
        "# In-loop safety gate: cost per decode step",
        "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC; commit at start: {code}",
        f"- hardware: {hardware(engine.runner.device)}; torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- model: {args.model} (hidden {engine.config.hidden_size}, {engine.config.num_layers} layers), "
        f"device {engine.runner.device}, dtype {args.dtype}",
        f"- gate: {source}",
        f"- settings: prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
        "(greedy, EOS ignored), "
        f"batches {args.batch_sizes}, {args.repeats} interleaved repeats per mode (+1 warm-up), "
        f"fetch medians over {args.fetch_calls} calls; KV tiers off",
        f"- command: `{' '.join(sys.argv)}`",
        "",
        "| batch | decode ms/step, gate off | gate on | on vs off | spread off / on | fetch us, off | on | "
        "gate's added us as % of a step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch, r in rows.items():
        lines.append(
            f"| {batch} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['delta_pct']:+.2f}% | "
            f"{r['spread_off']:.1f}% / {r['spread_on']:.1f}% | {r['fetch_off_us']:.1f} | "
            f"{r['fetch_on_us']:.1f} | {r['fetch_pct']:.3f}% |"
        )
    return "\n".join([*lines, "", *reading(rows)]) + "\n"


GOAL_PCT = 1.0  # the design's budget for the gate, as a share of a decode step


def reading(rows: dict[int, dict[str, float]]) -> list[str]:
    """What the table says, computed from it: the gate's added time, against the goal and the noise."""
    added = {batch: r["fetch_on_us"] - r["fetch_off_us"] for batch, r in rows.items()}
    shares = [r["fetch_pct"] for r in rows.values()]
    verdict = "under" if max(shares) < GOAL_PCT else "over"
    noisy = [b for b, r in rows.items() if abs(r["delta_pct"]) <= max(r["spread_off"], r["spread_on"])]
    resolved = [b for b in rows if b not in noisy]
    lines = [
        "## Reading it (computed from the table)",
        "",
        f"- The gate's added work per step (`fetch us` on minus off) is {_span(added.values(), 'us', 1)} "
        f"across batches {', '.join(str(b) for b in rows)}: {_span(shares, '%', 3)} of a decode step, "
        f"{verdict} the {GOAL_PCT:g} % goal.",
    ]
    if noisy:
        lines.append(
            f"- End to end, `on vs off` at batch {', '.join(str(b) for b in noisy)} lies within the spread "
            "between repeats of one mode, so it neither confirms nor contradicts the isolated figure."
        )
    if resolved:
        lines.append(
            f"- End to end, `on vs off` at batch {', '.join(str(b) for b in resolved)} exceeds the spread "
            "between repeats: "
            + "; ".join(f"batch {b}: {rows[b]['delta_pct']:+.2f}%" for b in resolved)
            + "."
        )
    return lines


def _span(values: Iterable[float], unit: str, digits: int) -> str:
    """`low-high unit`, or one value when they are equal at the shown precision."""
    values = list(values)
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low} {unit}" if low == high else f"{low}-{high} {unit}"


def parse_args() -> argparse.Namespace:
    """Command-line settings."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="name, path, or random:<shape>")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fetch-calls", type=int, default=2000)
    parser.add_argument(
        "--out", type=Path, help="markdown file (default bench/results/gate_overhead_<date>.md)"
    )
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args()


def main() -> None:
    """Measure every batch size and write the table."""
    args = parse_args()
    code = commit()  # the code this process imports, whatever lands while it runs
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if args.model.startswith("random:"):
            path = random_checkpoint(args.model.split(":", 1)[1], Path(tmp) / "model")
        max_batch = max(args.batch_sizes)
        engine = LLMEngine.load(
            path, device=args.device, dtype=args.dtype, max_batch_size=max_batch,
            max_seq_len=args.prompt_tokens + args.new_tokens + 8, progress=False,
        )  # fmt: skip
    gate, source = never_firing_gate(engine.config.hidden_size, engine.runner.device)
    rows = {}
    for batch in args.batch_sizes:
        rows[batch] = measure(engine, gate, args, batch)
        print(f"batch {batch}: {rows[batch]}", flush=True)
    text = render(args, engine, source, rows, code)
    print(text)
    if not args.no_write:
        out = args.out or REPO / "bench" / "results" / f"gate_overhead_{dt.date.today():%Y-%m-%d}.md"
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
