"""CPU latency of the prompt screen on long chats of short messages, as the gateway sends them.

    .venv/bin/python bench/safety_chat_latency.py [--sizes 50 200 600 1000] [--rounds 5]
        [--baseline /tmp/base] [--out bench/results/safety_chat_latency_<date>.md]

Each chat alternates user and assistant turns of ordinary short text (5 to 17 words about a hobby,
few of them repeated; one in ten is "Thanks!", "ok" or the like: fragments the screen joins),
chosen by a seeded generator, so a size and a round always give the same chat. A check is
Screen.check(rendered, turns=..., roles=...), the service's entry (gate, attack heads, deny
patterns, language), with the embedder's window cache emptied first: a new chat, not a stream
re-checked. Each round screens a chat of each size, a new chat per round. Rows are what the check
embeds (Scores.num_windows: every view's windows, clauses and restatements), then how many of
them differ and their tokens: the encoder's work. A chat past the screen's limit of rows is
refused (TextTooLong: the service answers INVALID_ARGUMENT): the table counts those apart and
times the rest (a size whose chats were all refused: the refusals).

With `--grown N`, each chat is first screened without its last N messages, untimed, and the check
of the whole chat that follows is timed: a conversation screened again as it grows, whose earlier
rows the embedder's cache still holds (rows are still the whole check's).

With `--baseline DIR` (a checkout of another commit: `git worktree add /tmp/base <commit>`), a
second process screens the same chats with DIR's services/, and the two take turns check by check
(which goes first alternates each round), so load from other work on the machine falls on both
alike; every chat's verdicts and scores are compared between the two. Worker processes inherit the
environment (OMP_WAIT_POLICY, OMP_NUM_THREADS: see the results page). The gateway refuses a check
that takes longer than its THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S (5 s by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench.machine; a worker puts its tree first

# A user turn is a question about a topic, an assistant turn an answer about it: 16 x 40 of each,
# so few turns of a chat repeat (the screen embeds a repeated text once).
QUESTIONS = (
    "what is a good way to get started with {}",
    "how much time should I spend on {} each week",
    "can you recommend a beginner book about {}",
    "what mistakes do people make with {}",
    "is {} expensive to get into",
    "how do I explain {} to my kids",
    "what equipment do I need for {}",
    "are there any free online courses on {}",
    "what is the history of {}",
    "how do I stay motivated with {}",
    "could you give me three tips for {}",
    "what should I read next about {}",
    "do you think {} is worth learning at my age",
    "how do I find a local group for {}",
    "what is the difference between a hobby and a career in {}",
    "which websites are good for {}",
)
ANSWERS = (
    "start small with {} and practise a little every day",
    "two or three hours a week of {} is plenty at first",
    "a short introduction to {} from your library is a good start",
    "many beginners rush {} instead of learning the basics",
    "{} can be cheap if you borrow what you need at first",
    "keep it simple and show them {} with an everyday example",
    "for {} you mostly need patience and a notebook",
    "yes, several universities offer free classes on {}",
    "{} has a long and interesting past worth reading about",
    "set small goals for {} and track your progress",
    "be curious, ask questions and enjoy {} with friends",
    "a popular magazine about {} has good reading lists",
    "it is never too late to start {}",
    "community centres often host meetings about {}",
    "the main difference is the time you give to {}",
    "forums and video channels about {} are a good place to look",
)
TOPICS = (
    "gardening", "photography", "chess", "baking bread", "watercolour painting", "birdwatching",
    "playing the guitar", "learning Spanish", "astronomy", "woodworking", "knitting", "hiking",
    "home brewing coffee", "running", "yoga", "pottery", "creative writing", "sailing",
    "cycling", "rock climbing", "calligraphy", "origami", "bonsai trees", "jazz piano",
    "board games", "cooking curry", "fishing", "swimming", "sketching portraits", "ballroom dancing",
    "keeping bees", "sewing", "public speaking", "budgeting", "beekeeping history", "tennis",
    "camping", "meditation", "model trains", "poetry",
)  # fmt: skip
OPENERS = ("", "", "", "Also, ", "Thanks. ", "One more thing: ", "Quick question: ", "Okay, ")
SHORT_TURNS = ("Thanks!", "ok", "Got it.", "Sounds good.", "Nice, thank you.", "Cool")


def chat_of(num_messages: int, seed: int) -> tuple[list[str], list[str]]:
    """A chat of `num_messages` turns, user first, then assistant and user in turn: (turns, roles)."""
    rng = random.Random(f"{num_messages}-{seed}")
    turns, roles = [], []
    for at in range(num_messages):
        role = "user" if at % 2 == 0 else "assistant"
        if rng.random() < 0.1:
            text = rng.choice(SHORT_TURNS)
        elif role == "user":
            text = rng.choice(OPENERS) + rng.choice(QUESTIONS).format(rng.choice(TOPICS)) + "?"
        else:
            text = rng.choice(ANSWERS).format(rng.choice(TOPICS)) + "."
        turns.append(text[0].upper() + text[1:])
        roles.append(role)
    return turns, roles


class Worker:
    """The screen of one tree, checking chats one at a time."""

    def __init__(self, tree: Path, num_grown: int = 0) -> None:
        sys.path.insert(0, str(tree))
        self.num_grown = num_grown
        from services.safety.classifier import TextTooLong
        from services.safety.config import SafetyConfig
        from services.safety.screen import Screen

        self.screen = Screen.load(SafetyConfig.from_env({}))
        self.too_long = TextTooLong
        self.num_rows = 0
        self.unique_rows: set[tuple[int, ...]] = set()
        classifier = self.screen.classifier
        score_turns, embed_windows = classifier.score_turns, classifier.embedder.embed_windows

        def counted(*args: Any, **kwargs: Any) -> Any:
            scores = score_turns(*args, **kwargs)
            self.num_rows = scores.num_windows
            return scores

        def embedded(rows: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            self.unique_rows |= {tuple(row) for row in rows}
            return embed_windows(rows, *args, **kwargs)

        classifier.score_turns = counted  # type: ignore[method-assign]
        classifier.embedder.embed_windows = embedded  # type: ignore[method-assign]
        self.check(8, 0)  # warm-up: the first check builds tables the rest share

    def check(self, num_messages: int, seed: int) -> dict[str, Any]:
        """Screens one chat; its wall and CPU seconds, rows, verdict and scores."""
        turns, roles = chat_of(num_messages, seed)
        self.screen.classifier.embedder._cache.clear()  # a new chat: nothing embedded before
        if self.num_grown:  # the chat so far, screened the turn before (the cache keeps its rows)
            self._screen(turns[: -self.num_grown], roles[: -self.num_grown])
        self.unique_rows = set()
        start, start_cpu = time.perf_counter(), time.process_time()
        reasons, scores = self._screen(turns, roles)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        return {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "rows": self.num_rows,
            "unique_rows": len(self.unique_rows),
            "tokens": sum(map(len, self.unique_rows)),
            "blocked": bool(reasons),
            "reasons": reasons,
            "scores": scores,
        }

    def _screen(self, turns: list[str], roles: list[str]) -> tuple[list[str], dict[str, float]]:
        """Screen.check on the chat as the gateway sends it: the verdict's reasons and scores."""
        text = "\n".join(f"{role}: {turn}" for role, turn in zip(roles, turns, strict=True))
        try:
            verdict = self.screen.check(text, "prompt", turns=turns, roles=roles)
        except self.too_long as refusal:  # the service answers INVALID_ARGUMENT
            self.num_rows = 0
            return [f"refused: {refusal}"], {}
        return list(verdict.reasons), verdict.scores


def serve(tree: Path, num_grown: int) -> None:
    """A worker process: one JSON request a line on stdin, one JSON answer a line on stdout."""
    worker = Worker(tree, num_grown)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(worker.check(request["size"], request["seed"])), flush=True)


class Remote:
    """A worker in a process of its own, for another tree's services/."""

    def __init__(self, tree: Path, num_grown: int) -> None:
        command = [sys.executable, __file__, "--serve", str(tree), "--grown", str(num_grown)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def check(self, num_messages: int, seed: int) -> dict[str, Any]:
        """Worker.check in the other process."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"size": num_messages, "seed": seed}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        """Ends the worker process."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def max_score_gap(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest difference between two checks' scores (inf when they score other categories)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((abs(a[c] - b[c]) for c in a), default=0.0)


def is_refused(check: dict[str, Any]) -> bool:
    """Whether the screen refused the chat as too long (TextTooLong)."""
    return any(reason.startswith("refused") for reason in check["reasons"])


def table(results: dict[str, dict[int, list[dict[str, Any]]]], sizes: list[int]) -> list[str]:
    """A markdown table: for each chat size, its rows (the first screened chat's) and each tree's
    p50 and max wall seconds and p50 CPU seconds (all threads) over the chats it screened; chats
    refused as too long are counted apart."""
    names = list(results)
    columns = [f"{name} {what}" for name in names for what in ("p50 s", "max s", "p50 CPU s")]
    lines = [
        "| messages | rows (unique, tokens) | refused | " + " | ".join(columns) + " |",
        "| ---: | ---: | ---: |" + " ---: |" * len(columns),
    ]
    for size in sizes:
        checks = results[names[0]][size]
        screened = [check for check in checks if not is_refused(check)]
        first = screened[0] if screened else None
        cells = [f"{first['rows']} ({first['unique_rows']}, {first['tokens']})" if first else "-"]
        cells.append(f"{len(checks) - len(screened)} of {len(checks)}")
        for name in names:
            timed = [check for check in results[name][size] if not is_refused(check)] or results[name][size]
            seconds = [check["seconds"] for check in timed]
            cpu = statistics.median(check["cpu_seconds"] for check in timed)
            cells += [f"{statistics.median(seconds):.2f}", f"{max(seconds):.2f}", f"{cpu:.2f}"]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return lines


def comparison(results: dict[str, dict[int, list[dict[str, Any]]]], sizes: list[int]) -> list[str]:
    """Whether the two trees gave every chat the same verdict, rows and scores."""
    (_, first), (_, second) = results.items()
    pairs = [(a, b) for size in sizes for a, b in zip(first[size], second[size], strict=True)]
    num_same_verdicts = sum(a["blocked"] == b["blocked"] and a["reasons"] == b["reasons"] for a, b in pairs)
    num_same_rows = sum(
        (a["rows"], a["unique_rows"], a["tokens"]) == (b["rows"], b["unique_rows"], b["tokens"])
        for a, b in pairs
    )
    gap = max(max_score_gap(a["scores"], b["scores"]) for a, b in pairs)
    num_refused = sum(is_refused(a) for a, _ in pairs)
    num_blocked = sum(a["blocked"] for a, _ in pairs) - num_refused
    return [
        f"- same verdict and reasons: {num_same_verdicts} of {len(pairs)} chats ({num_blocked} blocked, "
        f"{num_refused} refused as too long)",
        f"- same rows: {num_same_rows} of {len(pairs)}",
        f"- largest score difference: {gap:.3g}",
    ]


def main() -> None:
    """Times the screen on chats of each size, round after round; one tree, or two in turns."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 400, 600])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout, timed in turns with this one")
    parser.add_argument("--grown", type=int, default=0, help="time only the last N messages' check")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.grown)
    workers: dict[str, Any] = {"this tree": Worker(REPO, args.grown)}
    if args.baseline:
        workers = {"baseline": Remote(args.baseline, args.grown), "this tree": Remote(REPO, args.grown)}
    results: dict[str, dict[int, list[dict[str, Any]]]] = {n: {s: [] for s in args.sizes} for n in workers}
    load_before = os.getloadavg()
    for seed in range(args.rounds):
        order = list(workers) if seed % 2 == 0 else list(reversed(workers))
        for size in args.sizes:
            for name in order:
                result = workers[name].check(size, seed)
                results[name][size].append(result)
                print(f"round {seed} {size:5d} messages {name}: {result['seconds']:.2f} s, "
                      f"{result['rows']} rows", file=sys.stderr)  # fmt: skip
    for worker in workers.values():
        if isinstance(worker, Remote):
            worker.close()
    lines = report(args, results, load_before, os.getloadavg())
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def report(
    args: argparse.Namespace,
    results: dict[str, dict[int, list[dict[str, Any]]]],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> list[str]:
    """The run's settings, table and (with a baseline) comparison, as markdown lines."""
    import torch

    from bench.machine import cpu_name, git_commit

    lines = [
        f"- date: {datetime.date.today()}; commit {git_commit('services/safety', 'bench')}",
        f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        f"- load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after: {'/'.join(f'{x:.2f}' for x in load_after)}",
        f"- {args.rounds} rounds, a new chat of each size per round; sizes {args.sizes}"
        + (f"; baseline {args.baseline}" if args.baseline else ""),
        "",
        *table(results, args.sizes),
    ]
    if args.baseline:
        lines += ["", *comparison(results, args.sizes)]
    return lines


if __name__ == "__main__":
    main()
