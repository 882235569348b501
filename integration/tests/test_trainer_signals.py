"""Stopping ``ttnpu-train --replicas 2`` with a signal: real processes, deterministic runs.

SIGTERM or SIGINT to the supervisor stops both replicas after one agreed step, each with a
checkpoint of it, exit 0 and no process left (read from /proc); ``--resume`` then gives the losses
of an uninterrupted run, bit for bit (``--debug.deterministic --debug.seed 0``). A supervisor
killed with SIGKILL leaves no replica behind either.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ttnpu.trainer.run_folder import CHECKSUMS
from ttnpu.trainer.steplog import read_step_log

pytestmark = pytest.mark.e2e

STEPS = 10
COMMAND = ["--device", "cpu", "--replicas", "2", "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--checkpoint.interval", "5",
           "--debug.deterministic", "--debug.seed", "0"]  # fmt: skip
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    "OMP_NUM_THREADS": "1",
    "RUST_LOG": "warn",
}


def _start(run: Path, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ttnpu.trainer.cli", *args]
    if "--resume" not in args:
        cmd += [*COMMAND, "--dump_folder", str(run.parent), "--run-name", run.name]
    with (run.parent / f"{run.name}.log").open("ab") as log:
        return subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _log(run: Path) -> str:
    return (run.parent / f"{run.name}.log").read_text()


def _finish(proc: subprocess.Popen[bytes], run: Path) -> None:
    assert proc.wait(timeout=600) == 0, _log(run)[-3000:]


def _records(run: Path, replica: int) -> list[dict[str, Any]]:
    return read_step_log(run / f"replica_{replica}" / "steps.jsonl")


def _losses(run: Path, replica: int) -> dict[int, float]:
    """The loss of every committed step that no resume superseded."""
    current = [r for r in _records(run, replica) if "event" not in r and not r.get("superseded")]
    return {r["step"]: r["loss"] for r in current}


def _wait_for_step(proc: subprocess.Popen[bytes], run: Path, step: int) -> None:
    deadline = time.monotonic() + 400
    while (
        not (run / "replica_1" / "steps.jsonl").exists() or max(_losses(run, 1), default=0) < step
    ):
        assert proc.poll() is None, _log(run)[-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached: {_log(run)[-3000:]}"
        time.sleep(0.2)


def _replicas_of(supervisor: int) -> list[int]:
    """Every live process started for this supervisor, from the process table: each replica
    and its torchrun agent (whose command line holds the replica's)."""
    mark = f"--supervisor-pid\0{supervisor}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # exited meanwhile
            continue
    return pids


def _lighthouse_of(run: Path) -> int:
    """The pid of the Lighthouse the supervisor started (from its first lines)."""
    found = re.search(r"Lighthouse at \S+ \(pid (\d+)\)", _log(run))
    assert found, _log(run)[-3000:]
    return int(found.group(1))


def _gone(pid: int) -> bool:
    """Exited (a zombie left for init to reap counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """An uninterrupted run, training beside the tests that compare with it."""
    run = tmp_path_factory.mktemp("reference") / "straight"
    proc = _start(run, "--training.steps", str(STEPS))
    yield proc, run
    proc.kill()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the process table")
@pytest.mark.parametrize(
    ("signum", "resume"),
    [(signal.SIGTERM, True), (signal.SIGINT, False)],  # the resume is the same after either
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_stops_both_replicas_at_one_checkpointed_step_and_resume_matches(
    tmp_path: Path,
    reference: tuple[subprocess.Popen[bytes], Path],
    signum: signal.Signals,
    resume: bool,
) -> None:
    run = tmp_path / "stopped"
    job = _start(run, "--training.steps", str(STEPS))
    _wait_for_step(job, run, 2)
    replicas = [*_replicas_of(job.pid), _lighthouse_of(run)]
    assert len(replicas) == 5 and not any(_gone(p) for p in replicas)
    job.send_signal(signum)
    assert job.wait(timeout=120) == 0, _log(run)[-3000:]
    assert not _replicas_of(job.pid) and all(_gone(p) for p in replicas)
    stops = [[r for r in _records(run, i) if r.get("event") == "stop"] for i in range(2)]
    assert [len(s) for s in stops] == [1, 1], _log(run)[-3000:]
    step = stops[0][0]["step"]
    assert stops[1][0]["step"] == step < STEPS
    for i in range(2):
        checkpoint = run / f"replica_{i}" / "checkpoint" / f"step-{step}"
        assert stops[i][0]["checkpoint"] == str(checkpoint) and (checkpoint / CHECKSUMS).is_file()
        assert max(_losses(run, i)) == step  # the last committed step is the one checkpointed
    assert f"stopped by {signum.name} at step {step}; checkpoint" in _log(run)
    assert "Traceback" not in _log(run)
    if not resume:
        return
    _finish(_start(run, "--resume", str(run)), run)
    _finish(*reference)
    for i in range(2):
        expected = _losses(reference[1], i)
        assert sorted(expected) == list(range(1, STEPS + 1))
        assert _losses(run, i) == expected  # == on floats: bit for bit


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the process table")
def test_replicas_whose_supervisor_was_killed_stop_on_their_own(tmp_path: Path) -> None:
    run = tmp_path / "orphans"
    job = _start(run, "--training.steps", "1000")
    _wait_for_step(job, run, 2)
    assert len(_replicas_of(job.pid)) == 4
    lighthouse = _lighthouse_of(run)
    job.kill()
    job.wait()
    deadline = time.monotonic() + 60  # the orphan grace is 10 s; an agent may restart once
    while _replicas_of(job.pid) or not _gone(lighthouse):
        assert time.monotonic() < deadline, f"orphans left: {_log(run)[-3000:]}"
        time.sleep(0.2)
    assert "the supervisor (pid" in _log(run)
