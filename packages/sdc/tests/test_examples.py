"""examples/ (the README's example) runs as written in this package's venv and shows what it says:
the injected bit flip caught, confirmed and its update skipped, the other steps trained."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "veto_corrupted_steps.py"


def test_the_example_skips_the_step_whose_matmul_was_corrupted(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    *steps, summary = run.stdout.splitlines()
    assert len(steps) == 8
    assert steps[4].startswith("step 5: skipped (matmul at addmm:forward#"), steps[4]
    assert "transient" in steps[4]
    assert all(line.startswith(f"step {i}: loss ") for i, line in enumerate(steps, 1) if i != 5)
    assert summary.startswith("1 event(s) in ")
    assert Path(summary.split(" in ", 1)[1]).read_text().count('"kind": "matmul"') == 1
