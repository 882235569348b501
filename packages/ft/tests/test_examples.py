"""examples/replica.py (the README's example) runs as written in this package's venv: one replica
group with its own Lighthouse commits every step and its loss falls."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "replica.py"


def test_the_example_commits_every_step_and_learns(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "12"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("Lighthouse at http://")
    steps = [
        re.fullmatch(r"step (\d+): committed by 1 replica group\(s\), loss (\S+)", s)
        for s in lines[1:]
    ]
    assert all(steps) and [int(m[1]) for m in steps if m] == list(range(1, 13)), lines
    losses = [float(m[2]) for m in steps if m]
    assert losses[-1] < losses[0] / 2
