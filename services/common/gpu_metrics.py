"""GPU memory and HBM bandwidth utilisation through NVML, read when /metrics is scraped.

Needs the optional `gpu` extra (nvidia-ml-py) and an NVIDIA driver. Without either the metrics
are simply absent, and one log line says why. Bandwidth utilisation is NVML's memory
utilisation: the share of the last sample period (1/6 s to 1 s, by product) in which device
memory was being read or written, the same signal DCGM exports as DCGM_FI_DEV_MEM_COPY_UTIL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class GPUCollector(Collector):
    """One gauge family per NVML reading, one sample per visible GPU (labelled by its index)."""

    def __init__(self, nvml: ModuleType, handles: list[Any]) -> None:
        self.nvml = nvml
        self.handles = handles

    def collect(self) -> Iterator[Metric]:
        """Memory in use and in total, memory-bandwidth and compute utilisation."""
        used = _family("thermocline_gpu_memory_used_bytes", "Device memory in use (NVML).")
        total = _family("thermocline_gpu_memory_total_bytes", "Device memory in total (NVML).")
        bandwidth = _family(
            "thermocline_gpu_memory_bandwidth_utilization_ratio",
            "Share of the last NVML sample period in which device memory (HBM) was read or written.",
        )
        compute = _family(
            "thermocline_gpu_utilization_ratio",
            "Share of the last NVML sample period in which a kernel was running.",
        )
        for index, handle in enumerate(self.handles):
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            label = [str(index)]
            used.add_metric(label, memory.used)
            total.add_metric(label, memory.total)
            bandwidth.add_metric(label, rates.memory / 100.0)
            compute.add_metric(label, rates.gpu / 100.0)
        yield from (used, total, bandwidth, compute)


def _family(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["gpu"])


def open_nvml() -> GPUCollector | None:
    """A collector over every GPU NVML sees, or None (with a log line) when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        log.info("nvidia-ml-py is not installed (the `gpu` extra); GPU metrics are not exported")
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as error:
        log.info("NVML is unavailable (%s); GPU metrics are not exported", error)
        return None
    if not handles:
        log.info("NVML sees no GPU; GPU metrics are not exported")
        return None
    return GPUCollector(pynvml, handles)


_registered = False


def register_gpu_metrics() -> bool:
    """Adds the GPU collector to /metrics once per process; False when there is no GPU to read."""
    global _registered
    if _registered:
        return True
    collector = open_nvml()
    if collector is None:
        return False
    REGISTRY.register(collector)
    _registered = True
    return True
