"""Garbage-collector pauses: timed per generation, and kept off the start-up heap.

CPython's cyclic collector stops the whole process while it walks the tracked objects of the
generation it collects. A young collection walks the objects allocated since the last one, a
fraction of a millisecond; a full collection walks every tracked object in the process. Left
alone, what a service loads at start-up (grpc, protobuf descriptors, OpenTelemetry, redis-py, and
in the engine and safety service torch) sits in the oldest generation, so each full collection
walks it again, stopping whichever calls are in flight. In a run of 1,500 requests on a 16-CPU
host the gateway (about 70,000 tracked objects after start-up) stopped 37 ms for one, and the
safety service (200,000) 121 ms (bench/results/gc_pauses_2026-12-06_freeze.md).

`freeze_start_up_heap` moves everything alive once the service has started into the collector's
permanent generation (`gc.freeze`), which no collection walks: what start-up built lives as long as
the process anyway, and a full collection then walks only what was allocated since. The engine
also freezes before its step thread starts (services/engine/__main__.py).

`watch_gc_pauses` times every collection into `thermocline_gc_pause_seconds` by generation, so a
latency tail can be checked against the collector on a live service.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Gauge, Histogram

GC_PAUSE = Histogram(
    "thermocline_gc_pause_seconds",
    "Time the process stood still in one garbage collection, by the generation collected "
    "(0 youngest, 2 the full collection).",
    ["generation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
GC_FROZEN = Gauge(
    "thermocline_gc_frozen_objects",
    "Objects moved to the collector's permanent generation once the service had started; no "
    "collection walks them.",
)

_started_ns = 0
_by_generation = {generation: GC_PAUSE.labels(generation=str(generation)) for generation in range(3)}


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks entry: runs inside the collection, so it only reads the clock and observes."""
    global _started_ns
    if phase == "start":
        _started_ns = time.perf_counter_ns()
    elif (histogram := _by_generation.get(info.get("generation", -1))) is not None:
        histogram.observe((time.perf_counter_ns() - _started_ns) / 1e9)


def watch_gc_pauses() -> None:
    """Times every later collection of this process into GC_PAUSE (idempotent)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def freeze_start_up_heap() -> None:
    """Collects once, then moves every object alive into the permanent generation."""
    gc.collect()
    gc.freeze()
    GC_FROZEN.set(gc.get_freeze_count())
