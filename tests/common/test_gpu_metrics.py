"""GPU metrics through NVML: exported where NVML sees a GPU, absent with a log line otherwise."""

from __future__ import annotations

import importlib.util
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.gpu_metrics import open_nvml

GPU_NAMES = (
    "thermocline_gpu_memory_used_bytes",
    "thermocline_gpu_memory_total_bytes",
    "thermocline_gpu_memory_bandwidth_utilization_ratio",
    "thermocline_gpu_utilization_ratio",
)


def test_gpu_metrics_are_exported_or_their_absence_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="services.common.gpu_metrics"):
        collector = open_nvml()
    if collector is None:
        assert "GPU metrics are not exported" in caplog.text
        if importlib.util.find_spec("pynvml") is None:
            assert "nvidia-ml-py is not installed" in caplog.text
        return
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    for name in GPU_NAMES:
        assert f'{name}{{gpu="0"}}' in text, name
