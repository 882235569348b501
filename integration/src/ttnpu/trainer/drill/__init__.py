"""Fault drills: scripted faults on real ``ttnpu-train`` processes, with a report and plots.

``ttnpu-drill <scenario>|all`` (:mod:`.cli`) runs the scenarios of :mod:`.scenarios` (kills,
rejoins, bit flips, loss spikes) through :mod:`.runner` and writes :mod:`.report`. The exports
are imported on first use, so ``ttnpu-drill --help`` loads neither torch nor matplotlib.
"""

from typing import TYPE_CHECKING

from ttnpu.trainer._lazy import exports

if TYPE_CHECKING:
    from .report import draw, plot, render_markdown, write_report
    from .result import Curve, Figure, Marker, ScenarioResult, Span
    from .scenarios import SCENARIOS, Drill, Sizes

_EXPORTS = {
    "SCENARIOS": ".scenarios",
    "Curve": ".result",
    "Drill": ".scenarios",
    "Figure": ".result",
    "Marker": ".result",
    "ScenarioResult": ".result",
    "Sizes": ".scenarios",
    "Span": ".result",
    "draw": ".report",
    "plot": ".report",
    "render_markdown": ".report",
    "write_report": ".report",
}
__getattr__ = exports(__name__, _EXPORTS)
__all__ = [
    "SCENARIOS",
    "Curve",
    "Drill",
    "Figure",
    "Marker",
    "ScenarioResult",
    "Sizes",
    "Span",
    "draw",
    "plot",
    "render_markdown",
    "write_report",
]
