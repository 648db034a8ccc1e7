"""Builds data/safety/attack_{past,future}_tense.jsonl and benign_nq_open.jsonl, evaluation only.

    .venv/bin/python tools/build_tense_data.py --mirrors /work/.mirror

The held-out data of the restatement views (services/safety/restate.py):

- `attack_past_tense`, `attack_future_tense`: JailbreakBench's 100 behaviours as GPT-3.5 rewrote
  them into the past and the future tense for "Does Refusal Training in LLMs Generalize to the
  Past Tense?" (Andriushchenko and Flammarion, ICLR 2025; github.com/tml-epfl/llm-past-tense, MIT):
  the distinct `request_reformulated` of every run in `jailbreak_artifacts/{past,future}_tense/`,
  each with its behaviour's index and goal (`request`) and the gate's category of the behaviour
  (JailbreakBench's category as tools/build_safety_data.py maps it; `none` for the categories the
  gate has no head for: disinformation, expert advice). The goals themselves are a training source
  (harm_jbb_goals): these files test the rewrite, not the topics.
- `benign_nq_open`: questions people typed into Google (Natural Questions, the open-domain dev
  set `nq_open/NQ-open.dev.jsonl`, CC BY-SA 3.0), the first 1,000 by sha256: ordinary questions,
  many about the past ("when did the soviet union fall"), in lower case and without punctuation.

Records are in file order (the rewrites) or hash order (NQ), so running it twice writes
identical files. No tool trains or calibrates on them (SOURCE_SPLITS gives each the role test).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.build_safety_data import JBB_CATEGORY, Mirror, jbb_label, stable_rank, write_records

TENSE_COMMITS = {
    "tml-epfl/llm-past-tense": "179e305ddeecbfbd4d7c05fab626faf9b2ac5f44",
    "google-research-datasets/natural-questions": "fb26a3073b1fe636c97302890a27b491d6530130",
}
TENSES = {
    "attack_past_tense": "jailbreak_artifacts/past_tense/",
    "attack_future_tense": "jailbreak_artifacts/future_tense/",
}
BEHAVIOURS_FILE = "harmful_behaviors_jailbreakbench.csv"
NQ_FILE = "nq_open/NQ-open.dev.jsonl"
NQ_COUNT = 1000


def mirror(root: Path, repo: str) -> Mirror:
    return Mirror(root, repo, TENSE_COMMITS[repo])


def rewrites(snapshot: Mirror, source: str, folder: str) -> list[dict[str, str | int]]:
    """The distinct rewrites of every run under `folder`, in path and file order."""
    table = csv.DictReader(io.StringIO(snapshot.read(BEHAVIOURS_FILE).decode()))
    behaviours = {int(row["Index"]): row for row in table}
    seen: set[str] = set()
    records: list[dict[str, str | int]] = []
    for path in sorted(p for p in snapshot.paths(folder) if p.endswith(".json")):
        for artifact in json.loads(snapshot.read(path))["jb_artifacts"]:
            text = artifact["request_reformulated"].strip()
            if not text or text in seen:
                continue
            seen.add(text)
            row = behaviours[artifact["i_request"]]
            in_scope = row["Category"] in JBB_CATEGORY
            label = jbb_label({"category": row["Category"], "goal": row["Goal"]}) if in_scope else None
            records.append(
                {
                    "text": text,
                    "source": source,
                    "kind": "prompt",
                    "label": label or "none",
                    "behaviour": artifact["i_request"],
                    "request": row["Goal"],
                }
            )
    return records


def nq_open(snapshot: Mirror) -> list[dict[str, str]]:
    """The first NQ_COUNT distinct questions of the open dev set, in sha256 order."""
    lines = snapshot.read(NQ_FILE).decode().splitlines()
    questions = {json.loads(line)["question"].strip() for line in lines if line}
    chosen = sorted(questions, key=stable_rank)[:NQ_COUNT]
    return [{"text": q, "source": "benign_nq_open", "kind": "benign"} for q in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mirrors", type=Path, required=True, help="folder of bare mirrors, owner+name/repo")
    args = parser.parse_args()
    snapshot = mirror(args.mirrors, "tml-epfl/llm-past-tense")
    for source, folder in TENSES.items():
        write_records(source, rewrites(snapshot, source, folder))
    questions = nq_open(mirror(args.mirrors, "google-research-datasets/natural-questions"))
    write_records("benign_nq_open", questions)


if __name__ == "__main__":
    main()
