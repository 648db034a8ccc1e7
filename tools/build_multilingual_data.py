"""Builds data/safety/multilingual_*.jsonl: non-English harmful and benign prompts, evaluation only.

    .venv/bin/python tools/build_multilingual_data.py --mirrors /work/.mirror

The held-out data of the language screen (services/safety/language.py): the safety service's
encoder reads English only, so these files measure how it fares on requests written in other
languages. No tool trains or calibrates on them (SOURCE_SPLITS gives each the role test).

Reads git snapshots of public repositories (bare mirrors `owner+name/repo`, as
tools/build_safety_data.py reads them) at the commits pinned in COMMITS, and writes one JSONL file
per source, one record per line: `{"text", "source", "kind": "prompt", "label": "harmful" or
"benign", "lang"}`, plus `"en"` (the English original) where the source pairs each translation
with one. At most PER_LANGUAGE texts a language (MGSM: MGSM_PER_LANGUAGE), the first distinct
texts in sha256 order of the text, so running it twice writes identical files. Sources, licences
and counts: data/safety/SOURCES.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.build_safety_data import CATQA_CATEGORY, CATQA_FILE, COMMITS, Mirror, stable_rank, write_records

# owner/name -> the commit every file is read at (recorded in SOURCES.md). CatQA's is the commit
# its English file (harm_catqa) was read at.
MULTILINGUAL_COMMITS = {
    "declare-lab/red-instruct": COMMITS["declare-lab/red-instruct"],
    "DAMO-NLP-SG/multilingual-safety-for-LLMs": "577ac511437e07a256130945ef312a99158a18ad",
    "Jarviswang94/Multilingual_safety_benchmark": "8c55b6a6cda594cd550a4921513238a2dd40eb5a",
    "google-research/url-nlp": "452a21ad3dae5668c06ceeac21ff073e1e40f9be",
}
PER_LANGUAGE = 150
# MGSM's questions are long (Telugu, Bengali and Thai take 3 bytes a character): 120 a language and
# no English field (its English is GSM8K's test question, `mgsm/mgsm_en.tsv`) keep the four files
# under 1.5 MB.
MGSM_PER_LANGUAGE = 120
HARMFUL, BENIGN = "harmful", "benign"

# CatQA's translations (file stem -> language). The categories are harm_catqa's nine: political
# campaigning and tailored financial advice are left out, as there.
CATQA_TRANSLATIONS = {"chinese": "zh", "vietnamese": "vi"}
MULTIJAIL_FILE = "data/MultiJail.csv"
MULTIJAIL_LANGUAGES = ("zh", "it", "vi", "ar", "ko", "th", "bn", "sw", "jv")
# XSafety: its "unsafe instruction topic" file alone, the one whose rows are mostly requests (the
# other categories are mostly statements and opinions, some harmless). Folder -> language; its
# Bengali copy is a spreadsheet and is not read. Rows are aligned across languages.
XSAFETY_FILE = "{folder}/Unsafe_Instruction_Topic.csv"
XSAFETY_ENGLISH = "en/Unsafe_Instruction_Topic_n.csv"
XSAFETY_FOLDERS = {
    "ar": "ar",
    "de": "de",
    "fr": "fr",
    "hi": "hi",
    "ja": "ja",
    "ru": "ru",
    "sp": "es",
    "zh": "zh",
}
MGSM_FILE = "mgsm/mgsm_{lang}.tsv"
MGSM_LANGUAGES = ("bn", "de", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")

Pair = tuple[str, str, str | None]  # (language, text, English original or None)


def mirror(root: Path, repo: str) -> Mirror:
    """The snapshot of `repo` at its pinned commit."""
    return Mirror(root, repo, MULTILINGUAL_COMMITS[repo])


def catqa(root: Path) -> list[Pair]:
    """CatQA's Chinese and Vietnamese questions, each with the English one at its place."""
    snapshot = mirror(root, "declare-lab/red-instruct")
    english = json.loads(snapshot.read(CATQA_FILE))
    pairs: list[Pair] = []
    for stem, lang in CATQA_TRANSLATIONS.items():
        translated = json.loads(snapshot.read(CATQA_FILE.replace("english", stem)))
        for category in CATQA_CATEGORY:
            originals = list(english[category].values())
            for index, questions in enumerate(translated[category].values()):
                if len(questions) != len(originals[index]):
                    raise ValueError(f"CatQA {stem} {category}: not aligned with the English file")
                pairs += [(lang, q, e) for q, e in zip(questions, originals[index], strict=True)]
    return pairs


def multijail(root: Path) -> list[Pair]:
    """MultiJail's 315 prompts in each of its nine languages, with the English one."""
    data = mirror(root, "DAMO-NLP-SG/multilingual-safety-for-LLMs").read(MULTIJAIL_FILE)
    rows = list(csv.DictReader(io.StringIO(data.decode("utf-8-sig"))))
    return [(lang, row[lang], row["en"]) for row in rows for lang in MULTIJAIL_LANGUAGES]


def single_column(data: bytes) -> list[str]:
    """The first cell of each row of a one-column CSV file."""
    return [row[0] if row else "" for row in csv.reader(io.StringIO(data.decode("utf-8-sig")))]


def xsafety(root: Path) -> list[Pair]:
    """XSafety's unsafe-instruction prompts in eight languages, with the English row."""
    snapshot = mirror(root, "Jarviswang94/Multilingual_safety_benchmark")
    english = single_column(snapshot.read(XSAFETY_ENGLISH))
    pairs: list[Pair] = []
    for folder, lang in XSAFETY_FOLDERS.items():
        texts = single_column(snapshot.read(XSAFETY_FILE.format(folder=folder)))
        if len(texts) != len(english):
            raise ValueError(f"XSafety {folder}: {len(texts)} rows, English {len(english)}")
        pairs += [(lang, text, e) for text, e in zip(texts, english, strict=True)]
    return pairs


def mgsm_questions(data: bytes) -> list[str]:
    """The questions of an MGSM file (`question<TAB>answer` a line)."""
    return [line.rsplit("\t", 1)[0] for line in data.decode("utf-8-sig").splitlines() if line.strip()]


def mgsm(root: Path) -> list[Pair]:
    """MGSM's grade-school maths questions in ten languages, with the English one."""
    snapshot = mirror(root, "google-research/url-nlp")
    english = mgsm_questions(snapshot.read(MGSM_FILE.format(lang="en")))
    pairs: list[Pair] = []
    for lang in MGSM_LANGUAGES:
        questions = mgsm_questions(snapshot.read(MGSM_FILE.format(lang=lang)))
        if len(questions) != len(english):
            raise ValueError(f"MGSM {lang}: {len(questions)} questions, English {len(english)}")
        pairs += [(lang, q, e) for q, e in zip(questions, english, strict=True)]
    return pairs


def records(
    name: str, label: str, pairs: list[Pair], cap: int = PER_LANGUAGE, with_english: bool = True
) -> list[dict[str, str]]:
    """At most `cap` distinct texts a language, chosen by hash, languages in code order."""
    english: dict[tuple[str, str], str | None] = {}
    for lang, text, original in pairs:
        text = text.strip()
        if text:
            english.setdefault((lang, text), original.strip() if original else None)
    chosen: list[dict[str, str]] = []
    for lang in sorted({lang for lang, _ in english}):
        texts = sorted((t for code, t in english if code == lang), key=stable_rank)[:cap]
        for text in texts:
            record = {"text": text, "source": name, "kind": "prompt", "label": label, "lang": lang}
            original = english[(lang, text)]
            if original and with_english:
                record["en"] = original
            chosen.append(record)
    return chosen


def write(name: str, rows: list[dict[str, str]]) -> None:
    """data/safety/<name>.jsonl (build_safety_data's writer), and a line of counts by language."""
    write_records(name, rows)
    print(f"{name} by language: {dict(sorted(Counter(row['lang'] for row in rows).items()))}")


def main() -> None:
    """Reads every source at its pinned commit and writes its file."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mirrors", type=Path, required=True, help="folder of owner+name/repo bare mirrors")
    args = parser.parse_args()
    write("multilingual_catqa", records("multilingual_catqa", HARMFUL, catqa(args.mirrors)))
    write("multilingual_multijail", records("multilingual_multijail", HARMFUL, multijail(args.mirrors)))
    write("multilingual_xsafety", records("multilingual_xsafety", HARMFUL, xsafety(args.mirrors)))
    mgsm_rows = records(
        "multilingual_mgsm", BENIGN, mgsm(args.mirrors), MGSM_PER_LANGUAGE, with_english=False
    )
    write("multilingual_mgsm", mgsm_rows)


if __name__ == "__main__":
    main()
