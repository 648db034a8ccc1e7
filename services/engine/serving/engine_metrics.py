"""The engine's Prometheus metrics: KV tiers, prefix cache, queues, preemptions, tokens.

Gauges and counters are read from `LLMEngine.stats()` when /metrics is scraped, so the decode
loop pays nothing for them. The histograms and the counter observed in the request path
(queue wait, batch sizes, latencies) live in the leaf `services/engine/metrics.py`.
Labels carry the tier and the intent class, never the tenant. Tokens/s is
`rate(thermocline_engine_generated_tokens_total[1m])`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.gpu_metrics import register_gpu_metrics
from services.engine.gate.safety_gate import GateStatus
from services.engine.kv.quant_error import QuantizationErrorEstimator

if TYPE_CHECKING:
    from services.engine.llm_engine import LLMEngine


class EngineCollector(Collector):
    """Turns one `stats()` snapshot into metric families at scrape time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.quant_error = _quant_error_estimator(engine)

    def collect(self) -> Iterator[Metric]:
        """Every engine metric, from one snapshot."""
        stats = self.engine.stats()
        tiers = {
            "hot": (stats.num_hot_tokens, stats.num_hot_capacity_tokens, stats.hot_bytes),
            "warm": (stats.num_warm_tokens, stats.num_warm_capacity_tokens, stats.warm_bytes),
        }
        yield _per_tier("thermocline_engine_kv_tokens", "Token positions held per KV tier.", tiers, 0)
        yield _per_tier(
            "thermocline_engine_kv_capacity_tokens", "Token positions each tier can hold.", tiers, 1
        )
        yield _per_tier("thermocline_engine_kv_bytes", "Device bytes in use per KV tier.", tiers, 2)
        occupancy = GaugeMetricFamily(
            "thermocline_engine_kv_occupancy_ratio",
            "Used share of each KV tier in device memory (the kvstore's own occupancy is "
            "thermocline_kvstore_stored_bytes / _capacity_bytes).",
            labels=["tier"],
        )
        for tier, (used, capacity, _) in tiers.items():
            occupancy.add_metric([tier], used / capacity if capacity else 0.0)
        yield occupancy
        yield from self._quantization_error()
        yield _counter(
            "thermocline_engine_prompt_tokens", "Prompt tokens received.", stats.num_prompt_tokens_total
        )
        yield _counter(
            "thermocline_engine_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (hit rate: divide by prompt tokens).",
            stats.num_prompt_tokens_cached,
        )
        yield _counter(
            "thermocline_engine_generated_tokens", "Tokens generated.", stats.num_generated_tokens_total
        )
        yield _counter(
            "thermocline_engine_preemptions", "Sequences preempted (recompute).", stats.num_preemptions
        )
        yield _counter(
            "thermocline_engine_warm_dropped_tokens",
            "Warm tokens dropped by the window policy.",
            stats.num_dropped_tokens,
        )
        hit = GaugeMetricFamily(
            "thermocline_engine_hot_attention_mass_ratio",
            "Share of attention mass on hot tokens, sampled on decode steps (1 when nothing is warm).",
        )
        hit.add_metric([], stats.hot_attention_mass)
        yield hit
        yield _gauge("thermocline_engine_running_sequences", "Sequences in the batch.", stats.num_running)
        yield _gauge("thermocline_engine_waiting_sequences", "Sequences queued.", stats.num_waiting)
        yield _queue_timeouts(self.engine)
        yield from _gate_families(self.engine)

    def _quantization_error(self) -> Iterator[Metric]:
        estimator = self.quant_error
        estimate = estimator.estimate() if estimator is not None else None
        if estimate is None:  # no warm tier, or no KV held yet
            return
        family = GaugeMetricFamily(
            "thermocline_engine_kv_quantization_error_ratio",
            "Relative L2 error of an INT4 KIVI round trip on sampled hot KV groups (last layer), by tensor.",
            labels=["tensor"],
        )
        family.add_metric(["key"], estimate.key_ratio)
        family.add_metric(["value"], estimate.value_ratio)
        yield family


def _gate_families(engine: LLMEngine) -> Iterator[Metric]:
    """The in-loop gate: its status (1 on the current one), its identity, and triggers per category."""
    report = engine.gate_report
    status = GaugeMetricFamily(
        "thermocline_engine_safety_gate_status",
        "1 on the in-loop gate's current status (ok, mismatch, unverified, uncovered, absent), else 0.",
        labels=["status"],
    )
    for value in GateStatus:
        status.add_metric([value.value], float(value is report.status))
    yield status
    info = GaugeMetricFamily(
        "thermocline_engine_safety_gate_info",
        "1 for the gate the engine holds; announced_sha256 is safety's (empty: not asked).",
        labels=["version", "sha256", "announced_sha256"],
    )
    info.add_metric([report.version, report.sha256, report.announced_sha256], 1.0)
    yield info
    triggers = CounterMetricFamily(
        "thermocline_engine_safety_triggers",
        "Sequences the in-loop gate ended, by category (one per category over its threshold).",
        labels=["layer", "category"],
    )
    for category, count in engine.safety_gate_triggers().items():
        triggers.add_metric(["in_loop", category], count)
    yield triggers


def _queue_timeouts(engine: LLMEngine) -> GaugeMetricFamily:
    """Each class's queue timeout: the queue-wait alert compares p99 waits against it."""
    family = GaugeMetricFamily(
        "thermocline_engine_queue_timeout_seconds",
        "Longest queue wait before a request of the class is refused, by intent class (configuration).",
        labels=["intent_class"],
    )
    for name, cls in engine.scheduler.classes.by_name.items():
        family.add_metric([name], cls.queue_timeout_s)
    return family


def _quant_error_estimator(engine: LLMEngine) -> QuantizationErrorEstimator | None:
    """An estimator when the engine has a warm tier to estimate for."""
    cache = engine.runner.kv_cache
    if cache.warm is None:
        return None
    return QuantizationErrorEstimator(cache.hot, engine.tiers.group_size)


def _per_tier(name: str, doc: str, tiers: dict[str, tuple[int, int, int]], index: int) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["tier"])
    for tier, values in tiers.items():
        family.add_metric([tier], values[index])
    return family


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)  # exposed as <name>_total


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


_collector: EngineCollector | None = None


def register_engine_metrics(engine: LLMEngine) -> None:
    """Expose `engine`'s metrics on the process's /metrics; a second call points them at `engine`."""
    global _collector
    if _collector is None:
        _collector = EngineCollector(engine)
        REGISTRY.register(_collector)
        register_gpu_metrics()
    _collector.engine = engine
    _collector.quant_error = _quant_error_estimator(engine)
