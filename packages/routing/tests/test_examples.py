"""examples/spike_rollback.py (the README's example) runs as written in this package's venv: the
bad batch's spike is found at its onset, training resumes from the checkpoint before it with
routes that age from 0 to Δt updates, and returns to live routing."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "spike_rollback.py"


def test_the_example_rolls_back_and_recovers_with_anticipatory_routing(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    spike, *anticipatory, end = run.stdout.splitlines()
    assert spike.startswith("step 60: loss ") and spike.endswith(
        "a spike from step 60: back to step-50"
    )
    assert [line.split(":")[0] for line in anticipatory] == [f"step {s}" for s in range(51, 63)]
    assert [line.split(", ")[1] for line in anticipatory] == ["ACTIVE"] * 10 + ["DRAIN"] * 2
    lags = [0, 1] + [2] * 10  # Δt = 2: the routes age to 2 updates and stay there
    assert [line.split(", ")[-1] for line in anticipatory] == [f"lag {lag}" for lag in lags]
    assert end.startswith("step 80: loss ") and end.endswith("NORMAL again")
