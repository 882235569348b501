"""The examples run as written in this package's venv: examples/train.py (the README's example)
logs torchtitan's step lines, trains the steps asked for and fills its run folder; the Slurm
recipe (examples/slurm/) trains two replica groups, each on its own loopback address."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


SLURM = Path(__file__).parents[1] / "examples" / "slurm"
FAKE_SRUN = """#!/usr/bin/env bash
# srun, as far as slurm.sbatch needs it: SLURM_NTASKS tasks on this host, task i with its own
# loopback address (127.0.0.<3+i>) standing for its node's network.
shift  # --kill-on-bad-exit=0
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i REPLICA_HOST=127.0.0.$((3 + i)) "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.e2e
def test_the_slurm_recipe_trains_two_replica_groups_on_their_own_addresses(tmp_path: Path) -> None:
    """slurm.sbatch as sbatch would run it (a stand-in srun on PATH): its Lighthouse on
    127.0.0.2, two replica groups that advertise 127.0.0.3 and 127.0.0.4, one shared run
    folder; both train every step together and exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_SUBMIT_DIR": str(Path(__file__).parents[2]),
        "LIGHTHOUSE_HOST": "127.0.0.2",
        "LIGHTHOUSE_PORT": str(port),
        "RUN": str(run),
    }
    args = ["--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size",
            "2", "--torchft-logs"]  # fmt: skip
    job = subprocess.run(
        ["bash", str(SLURM / "slurm.sbatch"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logged = job.stdout + job.stderr
    assert job.returncode == 0, logged[-4000:]
    for i in range(2):
        steps = [
            json.loads(line)
            for line in (run / f"replica_{i}" / "steps.jsonl").read_text().splitlines()
        ]
        committed = [r for r in steps if "event" not in r]
        assert [(r["step"], r["participants"]) for r in committed] == [(s, 2) for s in range(1, 5)]
    # torchft's quorum names each group by the address it advertised
    assert 'address: "http://127.0.0.3:' in logged and 'address: "http://127.0.0.4:' in logged
    assert 'store_address: "127.0.0.3:' in logged
    assert "Lighthouse listening on" in (run / "lighthouse.log").read_text()
