"""PNG plots: latency percentiles against load, one file per class (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from services.cli.loadgen.report import LevelResult, knees
from services.cli.loadgen.runner import OPEN
from services.cli.loadgen.sla import Sla

PANELS = (("ttft", "TTFT"), ("tpot", "time per output token"), ("e2e", "end to end"))
PERCENTILE_STYLES = (("p50_ms", "p50", "-"), ("p90_ms", "p90", "--"), ("p99_ms", "p99", "-"))


def write_plots(levels: list[LevelResult], slas: dict[str, Sla], prefix: Path) -> list[Path]:
    """Writes `<prefix>_<intent>.png` for every class; returns the paths."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'thermocline[loadgen]' (or drop --plots)"
        ) from None
    matplotlib.use("Agg")
    intents = list(levels[0].summary.classes) if levels else []
    found = knees(levels, slas)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return [_plot_class(levels, intent, slas.get(intent), found.get(intent), prefix) for intent in intents]


def _plot_class(
    levels: list[LevelResult], intent: str, sla: Sla | None, knee: float | None, prefix: Path
) -> Path:
    import matplotlib.pyplot as plt

    loads = [level.load for level in levels]
    unit = "requests/s (open loop)" if levels[0].mode == OPEN else "concurrent clients (closed loop)"
    figure, axes = plt.subplots(1, len(PANELS), figsize=(11, 3.2), dpi=80)
    for axis, (metric, title) in zip(axes, PANELS, strict=True):
        summaries = [level.summary.classes[intent].latency(metric) for level in levels]
        for key, label, style in PERCENTILE_STYLES:
            values = [getattr(s, key) if s is not None else float("nan") for s in summaries]
            axis.plot(loads, values, style, marker="o", markersize=3, label=label)
        if sla is not None and metric in sla.limits:
            axis.axhline(sla.limits[metric], color="red", linestyle=":", label="SLA (p99)")
        if knee is not None:
            axis.axvline(knee, color="grey", linestyle=":", label="knee")
        axis.set(title=title, xlabel=unit, ylabel="ms")
        axis.grid(alpha=0.3)
    handles = {
        label: handle
        for axis in axes
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True)
    }
    axes[0].legend(handles.values(), handles.keys(), fontsize=7)
    figure.suptitle(f"{intent}: latency percentiles against load", fontsize=10)
    figure.tight_layout()
    path = prefix.parent / f"{prefix.name}_{intent}.png"
    figure.savefig(path)
    plt.close(figure)
    return path
