"""What the load generator sends: a mix of intent classes, each with its own prompt and output
lengths (and optionally an SLA), read from `--mix`, a TOML workload file, or a JSONL trace.

Formats are documented in services/cli/loadgen/README.md.
"""

from __future__ import annotations

import json
import random
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.cli.loadgen.distribution import LengthDistribution, parse_distribution
from services.cli.loadgen.sla import Sla, parse_sla_table

# Words that are one token each in most English BPE vocabularies and that no safety screen flags,
# so a synthetic prompt of N words is about N tokens (the report records the counted tokens).
_PROMPT_VOCABULARY = (
    "the river garden morning light table window paper music green house city road small quiet "
    "bread water summer winter school friend letter story answer question number simple common "
    "yellow blue orange market office library train station bridge forest mountain cloud rain "
    "coffee kitchen chair door street park evening night week month year history science color"
)
PROMPT_WORDS = tuple(_PROMPT_VOCABULARY.split())

# Lengths for intents named in --mix but not in a workload file: (prompt, output) distributions.
DEFAULT_PROFILES: dict[str, tuple[LengthDistribution, LengthDistribution]] = {
    "medical-diagnosis": (
        LengthDistribution("lognormal", 96, 0.4, min_tokens=16, max_tokens=384),
        LengthDistribution("uniform", min_tokens=32, max_tokens=64),
    ),
    "code-completion": (
        LengthDistribution("lognormal", 160, 0.5, min_tokens=16, max_tokens=512),
        LengthDistribution("uniform", min_tokens=8, max_tokens=32),
    ),
    "default": (
        LengthDistribution("lognormal", 64, 0.5, min_tokens=8, max_tokens=256),
        LengthDistribution("uniform", min_tokens=16, max_tokens=96),
    ),
    "batch": (
        LengthDistribution("lognormal", 256, 0.3, min_tokens=64, max_tokens=1024),
        LengthDistribution("uniform", min_tokens=64, max_tokens=128),
    ),
}


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send; `offset_s` is its arrival time in open-loop runs, None in closed loop."""

    intent: str
    prompt: str
    max_tokens: int
    chat: bool = False
    offset_s: float | None = None


@dataclass(frozen=True)
class ClassSpec:
    """One intent class of the mix."""

    intent: str
    weight: float
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    sla: Sla | None = None
    chat: bool = False

    def __post_init__(self) -> None:
        if not self.intent:
            raise ValueError("an intent class needs a name")
        if self.weight < 0:
            raise ValueError(f"class {self.intent!r}: weight must be >= 0, got {self.weight}")

    def draw(self, rng: random.Random) -> PlannedRequest:
        """One request of this class."""
        prompt = synthetic_prompt(self.prompt_tokens.sample(rng), rng)
        return PlannedRequest(self.intent, prompt, self.output_tokens.sample(rng), self.chat)


@dataclass(frozen=True)
class Workload:
    """The classes of a run and their shares of the arrivals."""

    classes: tuple[ClassSpec, ...]

    def __post_init__(self) -> None:
        names = [c.intent for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"intent classes must be unique, got {names}")
        if sum(c.weight for c in self.classes) <= 0:
            raise ValueError("the mix needs at least one class with a weight above 0")

    @property
    def shares(self) -> dict[str, float]:
        """Each class's share of the arrivals (weights normalised to sum to 1)."""
        total = sum(c.weight for c in self.classes)
        return {c.intent: c.weight / total for c in self.classes}

    @property
    def slas(self) -> dict[str, Sla]:
        """The classes that carry an SLA."""
        return {c.intent: c.sla for c in self.classes if c.sla is not None}

    def draw(self, rng: random.Random) -> PlannedRequest:
        """One request: a class picked by weight, then its lengths."""
        chosen = rng.choices(self.classes, weights=[c.weight for c in self.classes])[0]
        return chosen.draw(rng)


def synthetic_prompt(num_words: int, rng: random.Random) -> str:
    """A benign prompt of `num_words` words (about as many tokens)."""
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(num_words))


def parse_mix(text: str) -> dict[str, float]:
    """`a=0.7,b=0.2,c=0.1` → {a: 0.7, ...}; ratios need not sum to 1 (they are normalised)."""
    mix: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, ratio = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--mix item {item!r} is not INTENT=RATIO (e.g. default=0.5)")
        if name in mix:
            raise ValueError(f"--mix names {name!r} twice")
        try:
            mix[name] = float(ratio)
        except ValueError:
            raise ValueError(f"--mix ratio of {name!r} is not a number: {ratio!r}") from None
        if mix[name] < 0:
            raise ValueError(f"--mix ratio of {name!r} must be >= 0, got {mix[name]}")
    if sum(mix.values()) <= 0:
        raise ValueError(f"--mix {text!r} has no ratio above 0")
    return mix


def default_class(intent: str, weight: float) -> ClassSpec:
    """A class with the built-in lengths of its intent (those of `default` for unknown intents)."""
    prompt, output = DEFAULT_PROFILES.get(intent, DEFAULT_PROFILES["default"])
    return ClassSpec(intent, weight, prompt, output)


def load_workload_file(path: Path) -> dict[str, ClassSpec]:
    """The `[class.<intent>]` tables of a TOML workload file."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    unknown = set(data) - {"class"}
    if unknown or not data.get("class"):
        raise ValueError(f"{path}: expected only [class.<intent>] tables, found {sorted(data)}")
    return {
        name: _class_from_table(name, table, f"{path} [class.{name}]")
        for name, table in data["class"].items()
    }


def _class_from_table(name: str, table: dict[str, Any], where: str) -> ClassSpec:
    known = {"weight", "prompt_tokens", "output_tokens", "sla", "chat"}
    if unknown := set(table) - known:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    base = default_class(name, float(table.get("weight", 1.0)))
    return replace(
        base,
        prompt_tokens=parse_distribution(table["prompt_tokens"], f"{where} prompt_tokens")
        if "prompt_tokens" in table
        else base.prompt_tokens,
        output_tokens=parse_distribution(table["output_tokens"], f"{where} output_tokens")
        if "output_tokens" in table
        else base.output_tokens,
        sla=parse_sla_table(table["sla"], f"{where} sla") if "sla" in table else None,
        chat=bool(table.get("chat", False)),
    )


def build_workload(
    file_classes: dict[str, ClassSpec] | None,
    mix: dict[str, float] | None,
    slas: dict[str, Sla] | None = None,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
) -> Workload:
    """The run's classes: the file's, reweighted and restricted by `mix`, then flag overrides."""
    file_classes = file_classes or {}
    if mix is None:
        mix = {name: spec.weight for name, spec in file_classes.items()} or {"default": 1.0}
    classes = []
    for intent, weight in mix.items():
        spec = replace(file_classes.get(intent) or default_class(intent, weight), weight=weight)
        if prompt_tokens is not None:
            spec = replace(spec, prompt_tokens=LengthDistribution.constant(prompt_tokens))
        if output_tokens is not None:
            spec = replace(spec, output_tokens=LengthDistribution.constant(output_tokens))
        if slas and intent in slas:
            spec = replace(spec, sla=slas[intent])
        classes.append(spec)
    if slas and (stray := set(slas) - set(mix)):
        raise ValueError(f"--sla names classes that are not in the mix: {sorted(stray)}")
    return Workload(tuple(classes))


TRACE_KEYS = {"offset_s", "intent", "prompt", "prompt_tokens", "max_tokens", "chat"}


def load_trace(path: Path, rng: random.Random) -> list[PlannedRequest]:
    """A JSONL trace as planned requests, in arrival order (schema in the README)."""
    requests = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            requests.append(_trace_request(line, rng, f"{path}:{line_number}"))
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return sorted(requests, key=lambda r: r.offset_s or 0.0)


def _trace_request(line: str, rng: random.Random, where: str) -> PlannedRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON: {error}") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    if unknown := set(item) - TRACE_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(TRACE_KEYS)}")
    if ("prompt" in item) == ("prompt_tokens" in item):
        raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_tokens'")
    offset_s, max_tokens = item.get("offset_s"), item.get("max_tokens")
    if not isinstance(offset_s, int | float) or offset_s < 0:
        raise ValueError(f"{where}: 'offset_s' must be a number >= 0, got {offset_s!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    prompt = item["prompt"] if "prompt" in item else synthetic_prompt(int(item["prompt_tokens"]), rng)
    intent = str(item.get("intent", "default"))
    return PlannedRequest(intent, prompt, max_tokens, bool(item.get("chat", False)), float(offset_s))
