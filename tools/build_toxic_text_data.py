"""Builds data/safety's two held-out sources of toxic text: statements, not requests.

    .venv/bin/python tools/build_toxic_text_data.py --mirrors /work/.mirror \
        --wheels /tmp/thermocline-safety-wheels

The harm categories train on requests; these measure them on statements (bench/safety_eval.py's
"Toxic text"), and no tool trains or calibrates on them (tools/safety_data.py: test sources, in
neither LABELLED_FILES nor CALIBRATION_FILES):

- `toxic_moderation`: OpenAI's moderation evaluation set, real texts labelled by category;
- `toxic_toxigen`: ToxiGen's human-written statements about 16 groups (15 on the neutral side),
  hateful ones as hate and neutral ones, which name a group, as benign: the held-out look-alike
  of an identity statement.

Read from git snapshots at pinned commits (tools/build_safety_data.py's `Mirror`); a text near
a text that trains or calibrates the harm categories is left out (its word-set filter), and texts
are distinct after lower-casing and collapsing white space. Licences, counts and the label
mapping: data/safety/SOURCES.md.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.build_safety_data import HeldOutWords, Labelled, Mirror, jsonl_rows, stable_rank, write_labelled
from tools.safety_data import (
    CALIBRATION_FILES,
    TEST,
    fetch_wheels,
    first_of_each_text,
    load_examples,
    read_data_source,
)

TOXIGEN = ("microsoft/TOXIGEN", "01517e814639e0334c920a3c502036c8158aac87")
MODERATION = ("openai/moderation-api-release", "f4ab51b5edd3bfbcb349a56324274235b674e0e4")
TOXIGEN_PROMPTS = "prompts/"  # hate_<group>_1k.txt and neutral_<group>_1k.txt
# A prompt line is statements, each behind "- ", joined by a literal backslash-n; where a seed
# file's last line had no newline, the next statement follows on the same line after its dash.
_STATEMENT_DASH = re.compile(r"(?<=[.!?\"'])\s*-(?:\s+|$)")
MIN_WORDS = 4
MODERATION_FILE = "data/samples-1680.jsonl.gz"
# The moderation set's labels -> the gate's categories, the first set one deciding; harassment
# is hate's nearest here.
MODERATION_CATEGORY = {"S3": "sexual", "SH": "self_harm", "H2": "hate", "V2": "violence",
                       "H": "hate", "V": "violence", "S": "sexual", "HR": "hate"}  # fmt: skip
MODERATION_MAIN = ("S", "H", "V", "HR", "SH")  # all present and 0: benign


def main() -> None:
    """Reads both collections and writes their files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    args = parser.parse_args()
    seen = HeldOutWords(harm_fitting_texts(args.wheels))
    moderation = moderation_records(Mirror(args.mirrors, *MODERATION))
    toxigen = toxigen_records(Mirror(args.mirrors, *TOXIGEN))
    write_labelled("toxic_moderation", [r for r in moderation if not seen.is_near(r.text)])
    write_labelled("toxic_toxigen", [r for r in toxigen if not seen.is_near(r.text)])


def harm_fitting_texts(wheels: Path) -> list[str]:
    """Every text the harm categories are trained or calibrated on: the wheels' and data/safety's
    labelled training and calibration splits, the contrast frames (the head's benign training
    rows) and the calibration files."""
    texts = [e.text for e in load_examples(fetch_wheels(wheels)) if e.split != TEST]
    return texts + [
        t for name in ("benign_contrast_frames", *CALIBRATION_FILES) for t in read_data_source(name)
    ]


def toxigen_records(mirror: Mirror) -> list[Labelled]:
    """The distinct statements of ToxiGen's prompt files, hateful ones as hate and neutral ones
    as benign; a statement found on both sides is left out."""
    sides: dict[str, set[str]] = {"hate": set(), "neutral": set()}
    for path in mirror.paths(TOXIGEN_PROMPTS):
        side = path.removeprefix(TOXIGEN_PROMPTS).split("_", 1)[0]
        if side not in sides:
            continue
        for line in mirror.read(path).decode().splitlines():
            for part in line.split("\\n"):
                part = part.strip()
                if part.startswith("- "):
                    statements = (s.strip() for s in _STATEMENT_DASH.split(part[2:]))
                    sides[side].update(s for s in statements if len(s.split()) >= MIN_WORDS)
    both = sides["hate"] & sides["neutral"]
    records = [Labelled(t, "hate", "prompt") for t in sorted(sides["hate"] - both, key=stable_rank)]
    records += [Labelled(t, "benign", "prompt") for t in sorted(sides["neutral"] - both, key=stable_rank)]
    return first_of_each_text(records)


def moderation_records(mirror: Mirror) -> list[Labelled]:
    """The moderation set's texts: one with any label set is harmful, in the category of its first
    label in MODERATION_CATEGORY's order; one whose main labels are all present and 0 is benign;
    the rest (labels not known) are left out."""
    records = []
    for row in jsonl_rows(gzip.decompress(mirror.read(MODERATION_FILE))):
        text = row["prompt"].strip()
        flagged = [label for label in MODERATION_CATEGORY if row.get(label) == 1]
        if text and flagged:
            records.append(Labelled(text, MODERATION_CATEGORY[flagged[0]], "prompt"))
        elif text and all(row.get(label) == 0 for label in MODERATION_MAIN):
            records.append(Labelled(text, "benign", "prompt"))
    return first_of_each_text(records)


if __name__ == "__main__":
    main()
