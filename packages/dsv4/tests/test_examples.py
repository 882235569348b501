"""examples/train.py (the README's example) runs as written in this package's venv and the loss
falls. examples/titan_fsdp_ep.py needs 2 ranks: `nox -s examples` and `nox -s release` run it."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def test_the_training_example_lowers_the_loss(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    *steps, logits = run.stdout.splitlines()
    losses = [float(line.split("loss ")[1]) for line in steps]
    assert [line.split(":")[0] for line in steps] == [f"step {i}" for i in range(1, 6)]
    assert losses[-1] < losses[0]
    assert logits == "logits (2, 64, 2048)"
