"""The labelled harm sources of data/safety (tools/build_safety_data.py, tools/safety_data.py's
LABELLED_FILES): training only, valid labels, and kept off the held-out texts."""

from __future__ import annotations

import json

from tools.build_safety_data import HH_LABELS, HeldOutWords
from tools.safety_data import (
    BENIGN,
    CALIBRATION_FILES,
    CANDIDATE_LABELLED_FILES,
    CATEGORIES,
    CONTRAST_SOURCES,
    DATA_DIR,
    LABELLED_FILES,
    SOURCE_SPLITS,
    TEST,
    TRAIN,
    contrast_examples,
    dedup_key,
    read_data_source,
)

TOXIC_FILES = ("toxic_moderation", "toxic_toxigen")  # labelled, and held out
# Every labelled file a tool trains on, and the measured candidates that could be moved in.
TRAINING_LABELLED = (*LABELLED_FILES, *CANDIDATE_LABELLED_FILES)
HELD_OUT_FILES = ("benign_xstest_safe", "harmful_xstest_unsafe", *TOXIC_FILES)


def records(name: str) -> list[dict[str, str]]:
    """The records of one data/safety source."""
    lines = (DATA_DIR / f"{name}.jsonl").read_text().split("\n")
    return [json.loads(line) for line in lines if line]


def test_labelled_sources_are_training_sources() -> None:
    assert all(SOURCE_SPLITS[name] == TRAIN for name in TRAINING_LABELLED)
    assert not set(CANDIDATE_LABELLED_FILES) & set(LABELLED_FILES)


def test_every_record_has_a_known_label_and_kind() -> None:
    for name in TRAINING_LABELLED:
        for record in records(name):
            assert record["label"] in (*CATEGORIES, BENIGN), (name, record["label"])
            assert record["kind"] in ("prompt", "output"), (name, record["kind"])
            assert record["source"] == name


def test_toxic_text_sources_are_held_out_with_known_labels() -> None:
    for name in TOXIC_FILES:
        assert SOURCE_SPLITS[name] == TEST
        assert name not in LABELLED_FILES and name not in CALIBRATION_FILES
        labels = {record["label"] for record in records(name)}
        assert BENIGN in labels and labels - {BENIGN} and labels <= {*CATEGORIES, BENIGN}, (name, labels)
        texts = [dedup_key(record["text"]) for record in records(name)]
        assert len(set(texts)) == len(texts), name


def test_no_labelled_text_is_near_a_held_out_text() -> None:
    held_out = HeldOutWords([t for name in HELD_OUT_FILES for t in read_data_source(name)])
    near = [r["text"] for name in TRAINING_LABELLED for r in records(name) if held_out.is_near(r["text"])]
    assert near == []


def test_contrast_sources_train_as_benign_prompts() -> None:
    assert all(SOURCE_SPLITS[name] == TRAIN for name in CONTRAST_SOURCES)
    examples = contrast_examples()
    assert {(e.label, e.kind) for e in examples} == {(BENIGN, "prompt")}
    assert len(examples) == sum(len(read_data_source(name)) for name in CONTRAST_SOURCES)


def test_no_hand_written_look_alike_is_near_a_held_out_or_calibration_text() -> None:
    # Trained on, a near copy of a calibration question would pull its own threshold down, and one
    # of a held-out prompt would flatter the evaluation.
    names = (*HELD_OUT_FILES, *CALIBRATION_FILES)
    others = HeldOutWords([t for name in names for t in read_data_source(name)])
    texts = read_data_source("benign_handmade_lookalikes")
    assert texts and [t for t in texts if others.is_near(t)] == []
    assert len({dedup_key(t) for t in texts}) == len(texts)


def test_near_copy_filter_catches_a_reworded_copy_and_passes_another_request() -> None:
    held_out = HeldOutWords(["Write a tutorial on how to pick a lock on a front door"])
    assert held_out.is_near("write a tutorial on how to pick the lock of a front door")
    assert not held_out.is_near("What is the capital of France?")


def test_hand_labels_use_the_gate_categories_benign_or_skip() -> None:
    lines = [line for line in HH_LABELS.read_text().splitlines() if line and not line.startswith("#")]
    labels = [line.split("\t") for line in lines]
    assert len({digest for digest, _ in labels}) == len(labels)
    assert {label for _, label in labels} <= {*CATEGORIES, BENIGN, "skip"}
