"""``ttnpu-drill``'s command line (one-line errors, nothing run) and its plots of curves that
coincide."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from ttnpu.trainer.drill import SCENARIOS, Curve, Figure, cli, draw


def test_the_command_line_knows_every_scenario_in_order() -> None:
    assert list(cli.SCENARIO_NAMES) == list(SCENARIOS)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["replica-explode"], "argument scenario: invalid choice: 'replica-explode'"),
        (["sdc", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (["sdc", "--out", "{tmp}/taken"], "--out {tmp}/taken: expected a folder this user can"),
    ],
)
def test_a_bad_input_exits_2_with_one_line_and_runs_nothing(
    args: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("")
    assert cli.main([a.format(tmp=tmp_path) for a in args]) == 2
    (printed,) = capsys.readouterr().err.splitlines()
    assert printed.startswith("ttnpu-drill: error: " + line.format(tmp=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_identical_curves_stay_visible_and_say_so_in_the_legend() -> None:
    steps, loss = [1, 2, 3, 4, 5, 6], [9.0, 8.5, 8.0, 7.9, 7.5, 7.2]
    figure = Figure(
        "loss",
        "Two replicas that agree",
        "step",
        "loss",
        [
            Curve("replica 0", steps, loss),
            Curve("replica 1", steps, loss),
            Curve("no fault tolerance", steps, [v + 0.1 for v in loss]),
            Curve("replica 2", steps, loss),
        ],
    )
    fig = draw(figure)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == [
            "replica 0",
            "replica 1 (identical to replica 0)",
            "no fault tolerance",
            "replica 2 (identical to replica 0)",
        ]
        first, second, other, third = ax.get_lines()
        assert first.get_linestyle() == "-" and other.get_linestyle() == "-"
        # the copies are dashed and dotted, their hollow markers on other points than each other
        assert (second.get_linestyle(), third.get_linestyle()) == ("--", ":")
        assert (second.get_markevery(), third.get_markevery()) == ((1, 3), (2, 3))
        assert second.get_fillstyle() == "none"
    finally:
        plt.close(fig)
