"""CPU latency of one prompt check, for one or more gate files, on the same short prompts.

    .venv/bin/python bench/safety_latency.py --gates /tmp/old/gate.safetensors /tmp/new/gate.safetensors

Each gate's classifier (embedder with the gate's adapters merged, prompt head, jailbreak head)
scores the same short prompts (XSTest's safe prompts, held out), one check at a time as the
service runs them; the gates take turns prompt by prompt, so load from other work on the machine
falls on each alike. Prints p50 / p90 / p99 in milliseconds per gate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import load_gate
from services.safety import decoders
from services.safety.classifier import TextClassifier
from services.safety.config import DEFAULT_GATE, DEFAULT_MAX_WINDOWS
from services.safety.embedder import MiniLMEmbedder
from tools.safety_data import read_data_source

SHORT_SOURCE = "benign_xstest_safe"


def classifier_for(path: Path) -> TextClassifier:
    """The service's classifier for the gate at `path`."""
    gate = load_gate(path)
    return TextClassifier(gate, MiniLMEmbedder.for_gate(gate), DEFAULT_MAX_WINDOWS)


def percentiles_ms(seconds: list[float]) -> str:
    """p50 / p90 / p99 of `seconds`, in ms."""
    cuts = statistics.quantiles([s * 1000 for s in seconds], n=100)
    return f"p50 {cuts[49]:.1f} ms, p90 {cuts[89]:.1f} ms, p99 {cuts[98]:.1f} ms"


def main() -> None:
    """Times every gate on the same prompts, in turns."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gates", type=Path, nargs="+", default=[DEFAULT_GATE])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [t for t in read_data_source(SHORT_SOURCE) if len(t) < 300][: args.num_prompts]
    classifiers = [classifier_for(p) for p in args.gates]
    timings: list[list[float]] = [[] for _ in classifiers]
    decoders.warm_up()  # the word tables the decoders read, built at start as Screen.load builds them
    for classifier in classifiers:
        classifier.score("warm-up")
    for text in prompts:
        for classifier, times in zip(classifiers, timings, strict=True):
            start = time.perf_counter()
            classifier.score(text)
            times.append(time.perf_counter() - start)
    median_chars = statistics.median(len(t) for t in prompts)
    print(f"{len(prompts)} short prompts of {SHORT_SOURCE} (median {median_chars} characters), "
          f"{args.threads} torch threads")  # fmt: skip
    for path, times in zip(args.gates, timings, strict=True):
        print(f"- {path} (gate {load_gate(path).version}): {percentiles_ms(times)}")


if __name__ == "__main__":
    main()
