"""examples/train.py (the README's example) runs as written in this package's venv: torchtitan's
step lines are logged (the logger initialised), the steps asked for are trained, and the run
folder holds what the trainer writes."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def test_the_training_example_logs_its_steps(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its run folder goes to tempfile's dir
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    logged = run.stdout + run.stderr
    assert [int(s) for s in re.findall(r"step:\s+(\d+)\s", logged)] == [1, 2, 3]
    match = re.search(r"^trained 3 steps; run folder (\S+)$", run.stdout, re.M)
    assert match and Path(match[1]).parent == tmp_path
    assert any(Path(match[1]).iterdir())
