"""``ttnpu-train`` as a real process on the bundled corpus: the loss falls, the run folder holds
TensorBoard logs and checkpoints, and a resume continues at the same step, data and loss."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ttnpu.trainer import newest_verified_checkpoint

pytestmark = pytest.mark.e2e

_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+).*tps:\s+([0-9,]+)")


def _launch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    executable = Path(sys.executable).parent / "ttnpu-train"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(executable), "--device", "cpu", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


def _train(cwd: Path, *args: str) -> tuple[str, dict[int, float]]:
    """Run ttnpu-train; return its output and the loss of every logged step."""
    done = _launch(cwd, *args)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, {int(m.group(1)): float(m.group(2)) for m in _STEP.finditer(output)}


def _run_folder(cwd: Path, output: str) -> Path:
    match = re.search(r"run folder (\S+)", output)
    assert match, output[-2000:]
    return cwd / match.group(1)


def test_ttnpu_train_trains_and_writes_one_run_folder(tmp_path: Path) -> None:
    output, losses = _train(tmp_path, "--training.steps", "8", "--checkpoint.interval", "4")
    assert sorted(losses) == list(range(1, 9))
    first, last = losses[1], sum(losses[k] for k in (6, 7, 8)) / 3
    assert last < first - 0.5, losses
    assert all(int(m.group(3).replace(",", "")) > 0 for m in _STEP.finditer(output))  # tokens/s
    assert "progress: step 4/8 (50%)" in output and "progress: step 8/8 (100%)" in output

    run = _run_folder(tmp_path, output)
    assert run.parent == tmp_path / "runs" and (run / "command.json").is_file()
    assert newest_verified_checkpoint(run / "checkpoint").path.name == "step-8"  # SHA-256s
    manifests = run.glob("checkpoint/*/ttnpu-sha256.json")
    assert {p.parent.name for p in manifests} == {"step-4", "step-8"}
    events = list((run / "tb").rglob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(events[0].parent)).Reload()
    logged = {e.step: e.value for e in accumulator.Scalars("loss_metrics/global_avg_loss")}
    assert logged.keys() == losses.keys()
    assert all(abs(logged[k] - losses[k]) < 1e-3 for k in losses)


def test_resume_continues_at_the_same_step_data_position_and_loss(tmp_path: Path) -> None:
    """A 4-step run checkpoints at 2 and 4. A copy of it without step 4 resumes from step 2;
    steps 3 and 4 must see the same batches and give the same losses as the straight run."""
    output, straight = _train(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    run = _run_folder(tmp_path, output)
    resumed_run = tmp_path / "runs" / "resumed"
    shutil.copytree(run, resumed_run, ignore=shutil.ignore_patterns("step-4", "tb"))

    output, resumed = _train(tmp_path, "--resume", str(resumed_run))
    assert "Training starts at step 3" in output
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4), (straight, resumed)
    assert newest_verified_checkpoint(resumed_run / "checkpoint").path.name == "step-4"


def test_a_config_the_model_rejects_is_a_clear_error_and_leaves_no_run_folder(
    tmp_path: Path,
) -> None:
    done = _launch(tmp_path, "--training.seq_len", "8192")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "invalid config dsv4_debug: training.seq_len 8192 exceeds" in done.stderr
    assert list((tmp_path / "runs").iterdir()) == []


def test_an_unreachable_lighthouse_is_a_clear_error_and_leaves_no_run_folder(
    tmp_path: Path,
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{sock.getsockname()[1]}"
    done = _launch(tmp_path, "--fault_tolerance.enable", "--fault_tolerance.lighthouse", address)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cannot reach the Lighthouse at {address}" in done.stderr
    assert list((tmp_path / "runs").iterdir()) == []
