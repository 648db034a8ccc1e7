"""Intent classes: the example file under deploy/engine loads, bad files and names are refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.errors import UnknownIntentClass
from services.engine.scheduling.intent_class import IntentClass, IntentClasses
from tests.engine.scheduling.test_scheduler import _chunks, _run, _scheduler, _seq

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "engine" / "intent_classes.toml"


def test_the_example_file_names_the_gateways_priority_classes() -> None:
    import json

    classes = IntentClasses.load(EXAMPLE)
    intents = json.loads((EXAMPLE.parents[1] / "gateway" / "intents.json").read_text())["intents"]
    assert {i["priority_class"] for i in intents.values()} == set(classes.by_name)
    assert set(IntentClasses.builtin().by_name) == set(classes.by_name)
    assert classes.get("critical").reserved_slots == 2 and classes.get("critical").hot_tokens == 512
    assert classes.get("").name == "standard"  # a request that names no class
    classes.check_fits(16)
    with pytest.raises(ValueError, match="reserve 4 slots but max_batch_size is 3"):
        classes.check_fits(3)


def test_reservations_that_take_every_slot_are_refused_naming_the_classes_and_settings() -> None:
    """critical, interactive and standard reserve 2 + 1 + 1: at a batch of 4, batch could never start
    (its requests waited out the queue timeout); at 5 one slot is its."""
    classes = IntentClasses.load(EXAMPLE)
    with pytest.raises(ValueError) as refused:
        classes.check_fits(4)
    message = str(refused.value)
    assert (
        "reserve all 4 batch slots (critical 2, interactive 1, standard 1), so batch could never start"
        in message
    )
    assert "THERMOCLINE_ENGINE_MAX_BATCH_SIZE" in message and "THERMOCLINE_ENGINE_INTENT_CLASSES" in message
    classes.check_fits(5)
    everyone_reserves = IntentClasses(
        {
            "standard": IntentClass("standard", reserved_slots=2),
            "critical": IntentClass("critical", reserved_slots=2),
        }
    )
    everyone_reserves.check_fits(4)  # each class still starts into its own slots


def test_unknown_names_and_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        UnknownIntentClass, match="unknown intent_class 'vip'; known classes: batch, critical"
    ):
        IntentClasses.builtin().get("vip")
    with pytest.raises(UnknownIntentClass) as long_name:
        IntentClasses.builtin().get("v" * 40_000)
    assert len(str(long_name.value)) < 200  # cut: a reply's status message must stay small
    bad = tmp_path / "classes.toml"
    bad.write_text("[class.standard]\npriorty = 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['priorty'\]"):
        IntentClasses.load(bad)
    with pytest.raises(ValueError, match="max_batch_share must be in"):
        IntentClass("x", max_batch_share=0.0)


def test_engine_config_reads_the_kv_and_class_settings() -> None:
    environ = {
        "THERMOCLINE_ENGINE_KV_TIERS": "true",
        "THERMOCLINE_ENGINE_KV_HOT_TOKENS": "256",
        "THERMOCLINE_ENGINE_KV_GROUP_SIZE": "128",
        "THERMOCLINE_ENGINE_KV_WARM_POLICY": "refuse",
        "THERMOCLINE_ENGINE_INTENT_CLASSES": str(EXAMPLE),
    }
    config = EngineConfig.from_env(environ)
    assert config.kv.tiers.enabled and config.kv.tiers.hot_tokens == 256 and config.kv.tiers.group_size == 128
    assert config.kv.tiers.policy.value == "refuse"
    assert config.intent_classes().get("batch").max_batch_share == 0.5
    with pytest.raises(ValueError, match="multiple of the KV block size 16"):
        EngineConfig.from_env({**environ, "THERMOCLINE_ENGINE_KV_GROUP_SIZE": "24"})


@pytest.mark.parametrize("max_batch_size", [EngineConfig.from_env({}).max_batch_size, 5])
@pytest.mark.parametrize("flood", [("interactive",), ("interactive", "batch")])
def test_with_the_shipped_table_a_flood_of_open_classes_leaves_standard_a_slot(
    max_batch_size: int, flood: tuple[str, ...]
) -> None:
    """One tenant floods the classes any caller may name (code-completion is `interactive`); another
    tenant's default-intent request still starts at once, at the default batch size and the smallest
    the table fits."""
    scheduler = _scheduler(num_blocks=256, max_batch_size=max_batch_size, classes=IntentClasses.load(EXAMPLE))
    for i in range(3 * max_batch_size):
        scheduler.add(_seq(f"flood{i}", 3, flood[i % len(flood)], salt="tenant-a", first=10 * i))
    for _ in range(3):
        _run(scheduler)
    assert scheduler.waiting["interactive"], "the flood outlasts the free slots"
    scheduler.add(_seq("default-intent", 3, "standard", salt="tenant-b", first=9000))
    assert ("default-intent", 3) in _chunks(_run(scheduler))
