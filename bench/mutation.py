"""A small mutation pass over the gateway's policy modules and the engine's scheduler.

    .venv/bin/python bench/mutation.py      # every mutation; writes bench/results/mutation_<date>.md
    .venv/bin/python bench/mutation.py --only relay-ignores-output-block --no-write

Each mutation is a named, hand-written change to one line of a committed file: the kind of small
bug a review could miss (a dropped check, a flipped comparison, min for max). For each, the script
exports the commit under test (`git archive`, so the working tree and other people's edits are never
touched) into a scratch copy, applies the one change, and runs the test files that should notice it
there. Each test set also runs once without any mutation; a mutation is *killed* when a test that
passed in that clean run fails, and *survives* otherwise, so a test that fails on its own can
neither count as a kill nor hide one.
The four mutations issue 11 names are marked; each must be killed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: `original` (which must occur exactly once in `path`) becomes `mutated`."""

    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    named_in_issue: bool = False


RATE_REFILL = "return math.min(capacity, value + math.max(0, now_us - at) * rate / 1000000)\nend"
SCHEDULING_TESTS = ("tests/engine/scheduling",)
RATE_LIMIT_TESTS = ("tests/gateway/test_rate_limiter.py", "tests/gateway/test_rate_limits.py")
MUTATIONS = (
    Mutation(
        "relay-ignores-output-block",
        "services/gateway/relay.py",
        "if verdict.decision == safety_pb2.DECISION_BLOCK:\n                    await _abandon(call)",
        "if False:\n                    await _abandon(call)",
        ("tests/cli/test_mesh_output_screen.py", "tests/gateway/test_relay.py"),
        named_in_issue=True,
    ),
    Mutation(
        "rate-limit-never-refills",
        "services/gateway/rate_limiter.py",
        RATE_REFILL,
        "return math.min(capacity, value)\nend",
        RATE_LIMIT_TESTS,
        named_in_issue=True,
    ),
    Mutation(
        "rate-limit-never-caps-burst",
        "services/gateway/rate_limiter.py",
        RATE_REFILL,
        "return value + math.max(0, now_us - at) * rate / 1000000\nend",
        RATE_LIMIT_TESTS,
        named_in_issue=True,
    ),
    Mutation(
        "engine-ignores-client-cancel",
        "services/engine/serving/servicer.py",
        "                self.engine.cancel(handle)",
        "                pass",
        (
            "tests/cli/test_mesh.py::test_cancelling_a_stream_cancels_the_engine_request",
            "tests/gateway/test_admission.py",
        ),
        named_in_issue=True,
    ),
    Mutation(
        "scheduler-preempts-highest-eligible-class",
        "services/engine/scheduling/scheduler.py",
        "return min(reversed(candidates), key=lambda s: self.classes.get(s.intent_class).priority)",
        "return max(reversed(candidates), key=lambda s: self.classes.get(s.intent_class).priority)",
        SCHEDULING_TESTS,
        named_in_issue=True,
    ),
    Mutation(
        "scheduler-preempts-regardless-of-class",
        "services/engine/scheduling/scheduler.py",
        "return min(reversed(candidates), key=lambda s: self.classes.get(s.intent_class).priority)",
        "return candidates[-1]",
        SCHEDULING_TESTS,
    ),
    Mutation(
        "scheduler-new-request-preempts-its-own-class",
        "services/engine/scheduling/scheduler.py",
        "own = self.classes.get(seq.intent_class).priority - (1 if is_admission else 0)",
        "own = self.classes.get(seq.intent_class).priority",
        SCHEDULING_TESTS,
    ),
    Mutation(
        "rbac-grants-any-model",
        "services/gateway/rbac.py",
        "operation in operations and fnmatch.fnmatchcase(model, pattern)",
        "operation in operations",
        ("tests/gateway/test_policy.py", "tests/gateway/test_policy_files.py"),
    ),
    Mutation(
        "rbac-binding-matches-absent-claim",
        "services/gateway/rbac.py",
        "values = held if isinstance(held, list) else [held] if held is not None else []",
        "values = held if isinstance(held, list) else [held]",
        ("tests/gateway/test_policy.py", "tests/gateway/test_policy_files.py"),
    ),
    Mutation(
        "budget-allows-one-token-over",
        "services/gateway/budget.py",
        "if asked > limits.max_request_tokens:",
        "if asked > limits.max_request_tokens + 1:",
        ("tests/gateway/test_budget.py", "tests/gateway/test_policy.py"),
    ),
    Mutation(
        "intents-unknown-intent-falls-back-to-default",
        "services/gateway/intents.py",
        "        if requested not in self.priority_classes:\n",
        "        if requested not in self.priority_classes and self.default_intent is None:\n",
        ("tests/gateway/test_policy.py", "tests/gateway/test_policy_files.py"),
    ),
    Mutation(
        "auth-sub-not-required",
        "services/gateway/auth.py",
        'options={"require": ["exp", "iss", "aud", "sub"], "verify_nbf": True},',
        'options={"require": ["exp", "iss", "aud"], "verify_nbf": True},',
        ("tests/gateway/test_jwt.py", "tests/gateway/test_auth.py"),
    ),
    Mutation(
        "auth-nbf-not-checked",
        "services/gateway/auth.py",
        '"verify_nbf": True},',
        '"verify_nbf": False},',
        ("tests/gateway/test_jwt.py", "tests/gateway/test_auth.py"),
    ),
    Mutation(
        "tenants-pattern-allows-trailing-newline",
        "services/gateway/tenants.py",
        "return _TENANT.fullmatch(tenant) is not None",
        'return re.match(_TENANT.pattern + "$", tenant) is not None',
        ("tests/gateway/test_jwt.py", "tests/gateway/test_auth.py", "tests/gateway/test_policy.py"),
    ),
    Mutation(
        "admission-one-stream-over-the-cap",
        "services/gateway/admission.py",
        "return self.num_in_flight < self.max_streams",
        "return self.num_in_flight <= self.max_streams",
        ("tests/gateway/test_admission.py",),
    ),
)


@dataclass(frozen=True)
class Run:
    """How one pytest run over a copy ended: its exit status and the tests that failed."""

    return_code: int
    seconds: float
    summary: str
    failed: frozenset[str] = frozenset()

    @property
    def passed(self) -> bool:
        """pytest's exit status 0: every selected test passed."""
        return self.return_code == 0

    def newly_failed(self, clean: Run) -> list[str]:
        """Tests that failed here and passed in the clean run: the ones that caught the mutation."""
        if self.return_code < 0:  # timed out: the mutation hung something the clean run did not
            return ["(timed out)"] if clean.return_code >= 0 else []
        return sorted(self.failed - clean.failed)


def export_commit(commit: str, into: Path) -> None:
    """The committed tree at `commit`, written to `into` (no .git, no untracked files)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def apply(mutation: Mutation, tree: Path) -> None:
    """Writes the mutation into the copy; refuses a pattern that is missing or ambiguous."""
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise ValueError(f"{mutation.name}: the original occurs {count} times in {mutation.path}")
    path.write_text(text.replace(mutation.original, mutation.mutated))


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: float) -> Run:
    """pytest over `tests` inside the copy; every test runs, so a clean failure cannot hide a kill."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("THERMOCLINE_")}
    env["THERMOCLINE_SHARED_DIR"] = str(REPO.parent / "shared")  # the copy has no ../shared beside it
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = str(tree / "protos")  # the copy's stubs, not the editable install's
    command = [str(PYTHON), "-m", "pytest", "-q", "--no-header", "-rfE", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Run(-1, time.monotonic() - started, f"timed out after {timeout_s:g} s")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    failed = frozenset(  # "FAILED tests/x.py::test[param id] - message": the test id may hold spaces
        line.split(" ", 1)[1].split(" - ", 1)[0] for line in lines if line.startswith(("FAILED ", "ERROR "))
    )
    summary = lines[-1] if lines else "(no output)"
    return Run(result.returncode, time.monotonic() - started, summary, failed)


def in_copy(base: Path, scratch: Path, name: str) -> Path:
    """A fresh copy of the exported tree for one run."""
    tree = scratch / name
    shutil.copytree(base, tree, symlinks=True)
    return tree


def run_all(commit: str, mutations: list[Mutation], timeout_s: float) -> list[tuple[Mutation, Run, Run]]:
    """Each mutation with its test set's clean run and its mutated run."""
    results = []
    clean_runs: dict[tuple[str, ...], Run] = {}
    with tempfile.TemporaryDirectory(prefix="thermocline-mutation-") as tmp:
        scratch = Path(tmp)
        base = scratch / "base"
        export_commit(commit, base)
        for index, mutation in enumerate(mutations):
            if mutation.tests not in clean_runs:
                print(f"clean run: {' '.join(mutation.tests)}", flush=True)
                clean_runs[mutation.tests] = run_tests(
                    in_copy(base, scratch, f"clean-{index}"), mutation.tests, timeout_s
                )
            tree = in_copy(base, scratch, f"mutant-{index}")
            apply(mutation, tree)
            print(f"mutant {mutation.name}: {' '.join(mutation.tests)}", flush=True)
            mutated = run_tests(tree, mutation.tests, timeout_s)
            caught = mutated.newly_failed(clean_runs[mutation.tests])
            print(f"  {'killed' if caught else 'SURVIVED'} ({mutated.seconds:.0f} s): {caught}", flush=True)
            results.append((mutation, clean_runs[mutation.tests], mutated))
            shutil.rmtree(tree)
    return results


def verdict(clean: Run, mutated: Run) -> str:
    """killed (a test that passed clean fails), or survived."""
    return "killed" if mutated.newly_failed(clean) else "**survived**"


def report(commit: str, results: list[tuple[Mutation, Run, Run]], stamp: str) -> str:
    """The markdown report: one row per mutation, then what the counts say."""
    rows = [
        "| mutation | issue 11 | file | change | tests run | clean run | verdict | caught by |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mutation, clean, mutated in results:
        change = f"`{one_line(mutation.original)}` → `{one_line(mutation.mutated)}`"
        clean_text = (
            "pass" if clean.passed else "fails alone: " + ", ".join(sorted(clean.failed)) or clean.summary
        )
        rows.append(
            f"| {mutation.name} | {'yes' if mutation.named_in_issue else ''} | {mutation.path} | {change} | "
            f"{', '.join(mutation.tests)} | {clean_text} | {verdict(clean, mutated)} | "
            f"{', '.join(mutated.newly_failed(clean))} |"
        )
    killed = [m.name for m, c, r in results if r.newly_failed(c)]
    survived = [m.name for m, c, r in results if not r.newly_failed(c)]
    shaky = sorted({t for _, c, _ in results for t in c.failed})
    return "\n".join(
        [
            "# Mutation pass: gateway policy modules and the scheduler",
            "",
            f"- date (UTC): {stamp}",
            f"- commit under test: {commit}",
            f"- machine: {os.cpu_count()} logical cpus, 1-min load {os.getloadavg()[0]:.1f} at the end; "
            f"python {sys.version.split()[0]}",
            "- method: bench/mutation.py; each mutation applied alone to a `git archive` copy of the commit,",
            "  then pytest over the listed tests in that copy (real meshes where the tests start them). A",
            "  mutation is killed when a test that passed in the clean run of the same copy fails.",
            "",
            *rows,
            "",
            f"Killed {len(killed)} of {len(results)}; survived: {', '.join(survived) or 'none'}.",
            "",
            f"Tests that failed without any mutation: {', '.join(shaky) or 'none'}.",
            "",
        ]
    )


def one_line(text: str) -> str:
    """Code for a table cell: whitespace runs squeezed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--commit", default="HEAD", help="the commit whose code and tests are mutated")
    parser.add_argument("--only", action="append", help="run only this mutation (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per pytest run")
    parser.add_argument("--no-write", action="store_true", help="print the report instead of writing it")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", args.commit], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    results = run_all(commit, chosen, args.timeout_s)
    text = report(commit, results, stamp)
    if args.no_write:
        print(text)
    else:
        path = REPO / "bench" / "results" / f"mutation_{stamp.split()[0]}.md"
        path.write_text(text)
        print(f"wrote {path}")
    named_alive = [m.name for m, c, r in results if m.named_in_issue and not r.newly_failed(c)]
    return 1 if named_alive else 0


if __name__ == "__main__":
    sys.exit(main())
