"""Bitwise reproducibility through torchtitan's own switches (``--debug.deterministic
--debug.seed 0``): the same command gives the same losses, a run killed and resumed gives the
uninterrupted run's losses, and a run whose corrupted step was vetoed and re-run gives the clean
run's losses, bit for bit. The processes run side by side (one thread each) to keep this short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ttnpu.trainer.steplog import read_step_log

pytestmark = pytest.mark.e2e

STEPS = 40
COMMAND = ["--training.seq_len", "64", "--training.local_batch_size", "2",
           "--training.steps", str(STEPS), "--checkpoint.interval", "10",
           "--debug.deterministic", "--debug.seed", "0"]  # fmt: skip
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    "OMP_NUM_THREADS": "1",
}


def _start(run: Path, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--device", "cpu", *args]
    if "--resume" not in args:
        cmd += ["--dump_folder", str(run.parent), "--run-name", run.name]
    with (run.parent / f"{run.name}.log").open("ab") as log:
        return subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes], run: Path) -> None:
    assert proc.wait(timeout=900) == 0, (run.parent / f"{run.name}.log").read_text()[-3000:]


def _committed(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_step_log(run / "steps.jsonl") if "event" not in r]


def _losses(run: Path) -> dict[int, float]:
    """The loss of every committed step that no resume or rollback superseded (each step once)."""
    current = [r for r in _committed(run) if not r.get("superseded")]
    steps = [r["step"] for r in current]
    assert len(steps) == len(set(steps)), f"a step is committed twice: {steps}"
    return {r["step"]: r["loss"] for r in current}


def _kill_after(proc: subprocess.Popen[bytes], run: Path, step: int) -> None:
    """SIGKILL ``proc`` once it has committed ``step``."""
    deadline = time.monotonic() + 900
    while not any(r["step"] >= step for r in _committed(run)):
        assert proc.poll() is None, f"{run.name} exited before step {step}"
        assert time.monotonic() < deadline, f"{run.name} never reached step {step}"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_same_command_resume_and_vetoed_flip_are_bitwise_equal(tmp_path: Path) -> None:
    straight, resumed, flipped = tmp_path / "straight", tmp_path / "resumed", tmp_path / "flip"
    reference = _start(straight, *COMMAND)
    interrupted = _start(resumed, *COMMAND)
    _kill_after(interrupted, resumed, 23)  # its newest checkpoint is step 20
    # the same command with a bit flipped in a matmul of step 3, caught by the checksums
    flip = _start(flipped, *COMMAND, "--sdc.checksums", "always", "--sdc.inject_step", "3")
    _kill_after(flip, flipped, 8)
    again = _start(resumed, "--resume", str(resumed))
    _finish(reference, straight)
    _finish(again, resumed)

    expected = _losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert _losses(resumed) == expected  # == on floats: bit for bit
    assert any(r.get("superseded") for r in _committed(resumed))  # steps 21-23 were re-trained
    [start] = [r for r in read_step_log(resumed / "steps.jsonl") if r.get("event") == "start"][1:]
    assert start["step"] == 20 and start["superseded"] >= 3

    [discarded] = [r for r in read_step_log(flipped / "steps.jsonl") if r.get("event")
                   == "discarded"]  # fmt: skip
    assert (discarded["step"], discarded["vetoed"], discarded["sdc_events"] > 0) == (3, True, True)
    flipped_losses = _losses(flipped)
    assert flipped_losses == {s: expected[s] for s in flipped_losses} and len(flipped_losses) >= 8
