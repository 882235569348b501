"""Fault drills: scripted faults on real ``ttnpu-train`` processes, with a report and plots.

``ttnpu-drill <scenario>|all`` (:mod:`.cli`) runs the scenarios of :mod:`.scenarios` (kills,
rejoins, bit flips, loss spikes) through :mod:`.runner` and writes :mod:`.report`.
"""

from .report import draw, plot, render_markdown, write_report
from .result import Curve, Figure, Marker, ScenarioResult, Span
from .scenarios import SCENARIOS, Drill, Sizes

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
