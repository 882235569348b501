"""examples/replica.py (the README's example) runs as written in this package's venv: one replica
group with its own Lighthouse commits every step and its loss falls."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "replica.py"


def test_the_example_commits_every_step_and_learns(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    lighthouse, *lines = run.stdout.splitlines()
    assert lighthouse.startswith("Lighthouse at http://")
    pattern = r"step (\d+): committed by 1 replica group\(s\), loss (\S+)"
    steps = [m for line in lines if (m := re.fullmatch(pattern, line))]
    assert [int(m[1]) for m in steps] == list(range(1, 21)), lines
    losses = [float(m[2]) for m in steps]
    assert sum(losses[-5:]) < sum(losses[:5]) / 4
