"""Overlapped steps (`LLMEngine.overlap`): a decode step launched on the last step's sampled ids before
the host syncs on them. On the CPU the launch runs at once, but the path is the same one CUDA graphs
take: the ids never leave the device, and the last step is committed after the next one launched."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.env import EnvError
from services.engine.config import EngineConfig
from tests.engine.mixed_workload import CANCEL, mixed_run


def test_overlapped_steps_equal_plain_ones_under_joins_cancels_preemption_and_tiers(
    stories_hf_dir: Path,
) -> None:
    plain = mixed_run(stories_hf_dir, "cpu", graphs=False, overlap=False)
    overlapped = mixed_run(stories_hf_dir, "cpu", graphs=False, overlap=True)
    assert plain.overlapped == 0 and overlapped.overlapped > 100
    assert plain.preemptions >= 1 and overlapped.preemptions == plain.preemptions
    cancelled = plain.outputs[CANCEL[1]]
    assert 0 < len(cancelled) < 90  # cancelled mid-decode
    assert overlapped.outputs == plain.outputs


def test_overlap_setting_is_auto_unless_forced() -> None:
    assert EngineConfig.from_env({}).overlap is None
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "auto"}).overlap is None
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "true"}).overlap is True
    assert EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "off"}).overlap is False
    with pytest.raises(EnvError, match="THERMOCLINE_ENGINE_OVERLAP"):
        EngineConfig.from_env({"THERMOCLINE_ENGINE_OVERLAP": "sometimes"})
