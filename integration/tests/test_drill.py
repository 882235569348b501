"""``ttnpu-drill``: the report and its plots (fast), and every scenario run for real in its
``--quick`` form (e2e), its figures checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from ttnpu.trainer.drill import (
    Curve,
    Drill,
    Figure,
    Marker,
    ScenarioResult,
    Sizes,
    Span,
    cli,
    draw,
    plot,
    render_markdown,
    scenarios,
    write_report,
)
from ttnpu.trainer.drill.runner import DrillError, TrainProcess, lost_steps, wait_for


def loss_figure() -> Figure:
    return Figure(
        "loss",
        "Loss with a kill",
        "step",
        "training loss",
        [
            Curve("replica 0", [1, 2, 3, 4], [9.0, 8.5, 8.0, 7.9]),
            Curve("replica 1", [1, 2], [9.0, 8.5]),
        ],
        markers=[Marker(2, "replica 1 killed"), Marker(4, "healed")],
        spans=[Span(2, 4, "replica 1 absent"), Span(5, 6, "routing active")],
    )


def result(name: str = "replica-exit", ok: bool = True) -> ScenarioResult:
    return ScenarioResult(
        name=name,
        summary="a kill",
        figures={"steps_lost": [], "heal_bytes": 1234, "ratio": 0.98765},
        checks={"no committed step lost": True, "survived": ok},
        plots=[loss_figure()],
        notes=["measured here"],
    )


def test_a_plot_has_labelled_axes_every_curve_in_its_legend_and_the_events_marked() -> None:
    fig = draw(loss_figure())
    try:
        [ax] = fig.axes
        assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
            "step",
            "training loss",
            "Loss with a kill",
        )
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["replica 0", "replica 1", "replica 1 absent", "routing active"]
        annotations = [t.get_text() for t in ax.texts]
        assert annotations == ["replica 1 killed", "healed"]
        dashed = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"]
        assert dashed == [2, 4]
        assert len(ax.patches) == 2  # the two shaded stretches
    finally:
        plt.close(fig)


def test_a_bar_plot_names_its_categories() -> None:
    figure = Figure(
        "sdc",
        "flips",
        "where",
        "flips",
        [Curve("caught", [0, 1], [3, 5]), Curve("missed", [0, 1], [0, 2])],
        kind="bar",
        categories=["matmul", "gradient"],
    )
    fig = draw(figure)
    try:
        [ax] = fig.axes
        assert [t.get_text() for t in ax.get_xticklabels()] == ["matmul", "gradient"]
        assert [round(p.get_height()) for p in ax.patches] == [3, 5, 0, 2]
    finally:
        plt.close(fig)


def test_a_figure_without_curves_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'empty' has no curves"):
        plot(Figure("empty", "t", "x", "y", []), tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_the_report_holds_every_check_figure_and_plot(tmp_path: Path) -> None:
    results = [result(), result("kill-storm", ok=False)]
    md = write_report(results, tmp_path, "ttnpu-drill all --quick")
    text = md.read_text()
    assert "Result: **SOME CHECKS FAILED**" in text
    assert "| replica-exit | pass |" in text and "| kill-storm | FAIL |" in text
    assert "- [x] no committed step lost" in text and "- [ ] survived" in text
    assert "| ratio | 0.9877 |" in text and "| steps_lost | `[]` |" in text
    assert "![Loss with a kill](loss.png)" in text
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["passed"] is False
    assert document["scenarios"]["kill-storm"]["checks"]["survived"] is False
    assert document["scenarios"]["replica-exit"]["figures"]["heal_bytes"] == 1234
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.partial"))


def test_the_markdown_says_when_everything_passed() -> None:
    assert "Result: **all checks passed**" in render_markdown([result()], "ttnpu-drill sdc")


def test_a_scenario_that_breaks_is_reported_as_failed_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(drill: Drill) -> ScenarioResult:
        raise DrillError("replica0 exited (1) while waiting for the heal")

    table = {"broken": broken, "fine": lambda d: result("fine")}
    monkeypatch.setattr(scenarios, "SCENARIOS", table)
    results = cli.run_scenarios(["broken", "fine"], Drill(out=tmp_path))
    assert [r.passed for r in results] == [False, True]
    assert "replica0 exited (1) while waiting for the heal" in results[0].summary


def test_quick_sizes_shorten_every_drill() -> None:
    quick, full = Sizes.quick(), Sizes()
    assert quick.ft_steps < full.ft_steps and quick.spike_steps < full.spike_steps
    assert quick.storm_kills < full.storm_kills and len(quick.sdc_flips) < len(full.sdc_flips)


def test_waiting_on_a_process_that_died_names_it_and_shows_its_output(tmp_path: Path) -> None:
    log = tmp_path / "dead.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('no Lighthouse'); raise SystemExit(4)"], stdout=out
        )
    dead = TrainProcess("dead", tmp_path / "dead", proc, log)
    proc.wait()
    with pytest.raises(
        DrillError, match=r"dead exited \(4\) while waiting for the heal:\nno Lighthouse"
    ):
        wait_for("the heal", lambda: None, [dead], timeout=5)
    began = time.monotonic()
    with pytest.raises(DrillError, match="timed out after 0s waiting for nothing"):
        wait_for("nothing", lambda: None, [], timeout=0.3)
    assert time.monotonic() - began < 5


@pytest.mark.e2e
def test_every_scenario_runs_quick_and_its_figures_hold(tmp_path: Path) -> None:
    out = tmp_path / "drill"
    done = subprocess.run(
        [sys.executable, "-m", "ttnpu.trainer.drill.cli", "all", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    report = json.loads((out / "report.json").read_text())
    scenarios = report["scenarios"]
    failed = {n: s["checks"] for n, s in scenarios.items() if not s["passed"]}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:])
    figures = {name: s["figures"] for name, s in scenarios.items()}
    assert figures["ft-accuracy"]["largest_loss_difference"] <= 1e-3
    assert figures["ft-throughput"]["ratio_on_over_off"] > 0
    # a kill is survived: the survivor commits alone, nothing is lost
    assert figures["replica-exit"]["steps_committed_alone"] >= 3
    assert figures["replica-exit"]["steps_lost"] == []
    assert figures["replica-rejoin"]["heal_bytes"] > 0
    equal, total = figures["replica-rejoin"]["equal_model_tensors"].split("/")
    assert equal == total and int(total) > 0
    assert figures["kill-storm"]["rejoins"] == figures["kill-storm"]["kills"] >= 1
    assert figures["kill-storm"]["committed_steps_lost"] == 0
    # a killed replica is restarted by torchelastic, heals, and the job stops cleanly
    restart = figures["replica-restart"]
    assert restart["kills"] == restart["restarts_reported_by_the_supervisor"] >= 1
    assert restart["exit_status"] == 0 and restart["committed_steps_lost"] == []
    equal, total = restart["equal_model_tensors"].split("/")
    assert equal == total and int(total) > 0
    # a killed Lighthouse is restarted and training goes on; one kept down ends the job cleanly
    lost = figures["lighthouse-loss"]
    assert lost["lighthouse_restarts_reported"] == 1 and lost["committed_steps_lost"] == []
    assert lost["exit_status"] == 0 and lost["kept_down_exit_status"] == 5
    assert len(lost["kept_down_exit_lines"]) == 2
    # nothing corrupted is committed, every large flip is caught
    sdc = figures["sdc"]
    assert sdc["in_training"]["corrupted_steps_committed"] == 0
    assert sdc["in_training"]["caught"] == sdc["in_training"]["flips"] >= 1
    assert all(t["must_missed"] == 0 for t in sdc["offline"].values())
    # a spike is rolled back and, with anticipatory routing, does not recur
    spike = figures["loss-spike"]["anticipatory routing"]
    assert spike["rolled_back_to"] < spike["onset"] == spike["detected_at"]
    assert not spike["recurred"]
    plots = [p["name"] for s in scenarios.values() for p in s["plots"]]
    assert all((out / f"{name}.png").stat().st_size > 10_000 for name in plots)
    assert len(plots) == 10


def finished_process(folder: Path, name: str, steps: list[int]) -> TrainProcess:
    """A process that has exited, with a steps.jsonl committing ``steps`` in that order."""
    run = folder / name
    run.mkdir()
    records = [{"event": "start", "step": 0}, *({"step": s, "loss": 1.0} for s in steps)]
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return TrainProcess(name, run, proc, folder / f"{name}.log")


def test_lost_steps_are_the_gaps_of_a_group_and_the_steps_redone(tmp_path: Path) -> None:
    survivor = finished_process(tmp_path, "r0", [3, 4, 5, 6, 7, 8])  # healed at step 2
    killed = finished_process(tmp_path, "r1", [1, 2, 3, 4])
    assert lost_steps([survivor, killed], 8) == []
    assert lost_steps([survivor], 8) == [1, 2]
    redone = finished_process(tmp_path, "r2", [1, 2, 3, 3, 4])
    gap = finished_process(tmp_path, "r3", [5, 7, 8])
    assert lost_steps([redone, gap], 8) == [6, 3]
