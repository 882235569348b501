"""The drill report: ``report.json`` (every figure and check), ``report.md`` (a summary that
links the plots) and one PNG per :class:`Figure`, all in one folder."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training host
import matplotlib.pyplot as plt
from matplotlib.figure import Figure as MplFigure

from .result import Curve, Figure, ScenarioResult, Span

__all__ = ["draw", "plot", "render_markdown", "write_report"]

_SPAN_COLOURS = ("#fde0a0", "#c6e6c3", "#c9d8f0", "#f2c9d8", "#e0d0f0")
_IDENTICAL_STYLES = (("--", "o"), (":", "s"), ("-.", "^"))
"""Line style and marker of the 2nd, 3rd, ... of identical curves."""


def draw(figure: Figure) -> MplFigure:
    """``figure`` as a matplotlib figure: labelled axes, a legend, events as dashed vertical
    lines with their label, stretches shaded, curves identical to an earlier one visible on top
    of it. The caller closes it (``plt.close``)."""
    if not figure.curves:
        raise ValueError(f"figure {figure.name!r} has no curves to draw")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if figure.kind == "bar":
        _bars(ax, figure)
    else:
        _lines(ax, figure)
    for span in figure.spans:
        ax.axvspan(
            span.start,
            span.end,
            color=_span_colour(figure, span.label),
            alpha=0.5,
            label=span.label if _first_span(figure, span) else None,
        )
    top = ax.get_ylim()[1]
    for marker in figure.markers:
        ax.axvline(marker.x, color="black", linestyle="--", linewidth=0.9)
        ax.annotate(marker.label, (marker.x, top), rotation=90, va="top", ha="right",
                    fontsize=8, xytext=(-2, -2), textcoords="offset points")  # fmt: skip
    ax.set_title(figure.title)
    ax.set_xlabel(figure.xlabel)
    ax.set_ylabel(figure.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def plot(figure: Figure, path: Path) -> Path:
    """Draw ``figure`` into the PNG ``path``."""
    fig = draw(figure)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def _span_colour(figure: Figure, label: str) -> str:
    labels = list(dict.fromkeys(s.label for s in figure.spans))
    return _SPAN_COLOURS[labels.index(label) % len(_SPAN_COLOURS)]


def _first_span(figure: Figure, span: Span) -> bool:
    return next(s for s in figure.spans if s.label == span.label) is span


def _lines(ax: Any, figure: Figure) -> None:
    """One line per curve. A curve equal to an earlier one (replicas that agree exactly) would
    hide it: it is drawn dashed with hollow markers on other points than the earlier one's, and
    its legend entry says "identical to" the first of them."""
    groups: dict[tuple[tuple[float, ...], tuple[float, ...]], list[Curve]] = {}
    for curve in figure.curves:
        groups.setdefault((tuple(curve.x), tuple(curve.y)), []).append(curve)
    for curve in figure.curves:
        same = groups[(tuple(curve.x), tuple(curve.y))]
        rank = next(i for i, c in enumerate(same) if c is curve)
        if rank == 0:
            ax.plot(curve.x, curve.y, label=curve.label, linewidth=1.4, marker=".")
            continue
        dash, marker = _IDENTICAL_STYLES[(rank - 1) % len(_IDENTICAL_STYLES)]
        ax.plot(
            curve.x,
            curve.y,
            label=f"{curve.label} (identical to {same[0].label})",
            linewidth=1.4,
            linestyle=dash,
            marker=marker,
            fillstyle="none",
            markevery=(rank, len(same)),
        )


def _bars(ax: Any, figure: Figure) -> None:
    width = 0.8 / len(figure.curves)
    for i, curve in enumerate(figure.curves):
        xs = [x + (i - (len(figure.curves) - 1) / 2) * width for x in curve.x]
        ax.bar(xs, curve.y, width=width, label=curve.label)
    if figure.categories:
        ax.set_xticks(range(len(figure.categories)), figure.categories, fontsize=8)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, list | dict):
        return f"`{json.dumps(value)}`"
    return str(value)


def render_markdown(results: Sequence[ScenarioResult], command: str) -> str:
    """The summary: one section per scenario (its checks, figures, notes and plots)."""
    verdict = "all checks passed" if all(r.passed for r in results) else "SOME CHECKS FAILED"
    lines = ["# Fault drill report", "", f"Command: `{command}`", "", f"Result: **{verdict}**.", ""]
    lines += ["| scenario | result | seconds |", "|---|---|---|"]
    lines += [f"| {r.name} | {'pass' if r.passed else 'FAIL'} | {r.seconds:.0f} |" for r in results]
    for r in results:
        lines += ["", f"## {r.name}", "", r.summary, ""]
        lines += [f"- [{'x' if ok else ' '}] {check}" for check, ok in r.checks.items()]
        lines += ["", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_format(v)} |" for k, v in r.figures.items()]
        if r.notes:
            lines += [""] + [f"- {note}" for note in r.notes]
        for figure in r.plots:
            lines += ["", f"![{figure.title}]({figure.name}.png)"]
    return "\n".join(lines) + "\n"


def write_report(results: Sequence[ScenarioResult], out: Path, command: str) -> Path:
    """Write the PNGs, ``report.json`` and ``report.md`` into ``out``; returns the Markdown's
    path. Each file is written whole under a temporary name first, then renamed."""
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        for figure in r.plots:
            plot(figure, out / f"{figure.name}.png")
    document = {
        "command": command,
        "passed": all(r.passed for r in results),
        "scenarios": {
            r.name: {
                "passed": r.passed,
                "seconds": round(r.seconds, 1),
                "summary": r.summary,
                "checks": r.checks,
                "figures": r.figures,
                "notes": r.notes,
                "plots": [asdict(f) for f in r.plots],
            }
            for r in results
        },
    }
    _write(out / "report.json", json.dumps(document, indent=1) + "\n")
    return _write(out / "report.md", render_markdown(results, command))


def _write(path: Path, text: str) -> Path:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path
