"""What a drill scenario returns: its figures, its pass/fail checks and the data of its plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Curve", "Figure", "Marker", "ScenarioResult", "Span"]


@dataclass
class Curve:
    """One line of a plot (or, in a bar plot, one group of bars over ``x`` as categories)."""

    label: str
    x: list[float]
    y: list[float]


@dataclass
class Marker:
    """An event on the x axis (a kill, a heal, a flip, a rollback)."""

    x: float
    label: str


@dataclass
class Span:
    """A stretch of the x axis (a routing phase, a replica's absence)."""

    start: float
    end: float
    label: str


@dataclass
class Figure:
    """One PNG: what it shows (``title``), its axes and what is drawn on them."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    curves: list[Curve]
    markers: list[Marker] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    kind: Literal["line", "bar"] = "line"
    categories: list[str] = field(default_factory=list)
    """Bar plots: the label of each x position."""


@dataclass
class ScenarioResult:
    """A scenario's outcome. ``checks`` are the claims the drill makes (each must hold for the
    drill to pass); ``figures`` the measured numbers; ``notes`` say how they were obtained."""

    name: str
    summary: str
    figures: dict[str, Any]
    checks: dict[str, bool]
    plots: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(self.checks.values())
