"""tools/build_toxic_text_data.py reads ToxiGen's prompt files from a real git snapshot: each
statement once, merged statements split apart, a statement on both sides left out."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools.build_safety_data import Mirror
from tools.build_toxic_text_data import toxigen_records

HATE_LINE = (
    "- group x people are all lazy and should be sent away\\n- everyone knows group x cannot be trusted."
    "- group x people ruin every neighbourhood they move into\\n-"
)
NEUTRAL_LINE = (
    "- group x people celebrate a festival every spring\\n- too short\\n"
    "- everyone knows group x cannot be trusted.\\n-"
)


def snapshot(root: Path) -> tuple[Path, str]:
    """A bare git snapshot of a repository with ToxiGen's layout, and its commit."""
    work = root / "work"
    (work / "prompts").mkdir(parents=True)
    (work / "prompts" / "hate_x_1k.txt").write_text(HATE_LINE + "\n" + HATE_LINE + "\n")
    (work / "prompts" / "neutral_x_1k.txt").write_text(NEUTRAL_LINE + "\n")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "prompts"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    mirrors = root / "mirrors"
    subprocess.run(
        ["git", "clone", "-q", "--bare", str(work), str(mirrors / "o+toxigen" / "repo")], check=True
    )
    return mirrors, commit.stdout.strip()


def test_statements_are_split_deduplicated_and_kept_off_both_sides(tmp_path: Path) -> None:
    mirrors, commit = snapshot(tmp_path)
    records = toxigen_records(Mirror(mirrors, "o/toxigen", commit))
    by_label = {(r.label, r.text) for r in records}
    assert by_label == {
        ("hate", "group x people are all lazy and should be sent away"),
        ("hate", "group x people ruin every neighbourhood they move into"),  # split off the one before
        ("benign", "group x people celebrate a festival every spring"),
    }  # "too short" has three words; the statement on both sides is left out
    assert len(records) == len(by_label)
