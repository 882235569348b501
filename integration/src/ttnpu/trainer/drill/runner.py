"""Real ``ttnpu-train`` processes for the drills: start, kill, wait on their ``steps.jsonl``.

Every drill process is the trainer's own command line (``python -m ttnpu.trainer.cli``) with
one OpenMP thread, in ``<dump>/<name>/``, its output in ``<dump>/<name>.log``. Replica groups
join a Lighthouse the drill owns (:func:`lighthouse`), so a killed replica can be replaced by a
new process with the same replica id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ttnpu.ft import EmbeddedLighthouse
from ttnpu.trainer.launcher import replica_args
from ttnpu.trainer.steplog import read_step_log

__all__ = [
    "SMALL",
    "DrillError",
    "TrainProcess",
    "environment",
    "lighthouse",
    "lost_steps",
    "model_weights",
    "run_all",
    "start",
    "wait_for",
]

T = TypeVar("T")

SMALL = ("--training.seq_len", "64", "--training.local_batch_size", "2")
"""The drills' model input: 128 tokens a step, about 0.4 s a step for one process on a CPU core."""

TOKENS_PER_STEP = 64 * 2

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DrillError(RuntimeError):
    """A drill could not reach the state it waits for (a process died, a deadline passed)."""


def environment() -> dict[str, str]:
    """This environment for a drill process: one OpenMP thread, no torchrun rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn")
    return env


@dataclass
class TrainProcess:
    """One ``ttnpu-train`` process and its run folder."""

    name: str
    folder: Path
    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.time)

    def records(self) -> list[dict[str, Any]]:
        return read_step_log(self.folder / "steps.jsonl")

    def steps(self) -> list[dict[str, Any]]:
        """The committed steps, in the order they were logged."""
        return [r for r in self.records() if "event" not in r]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("event") == kind]

    def last_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up, no goodbye to the Lighthouse (a real crash)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        """The exit status; on timeout the process is killed and :class:`DrillError` raised."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            message = f"{self.name} did not finish within {timeout:.0f}s ({self.log})"
            raise DrillError(message) from None

    def tail(self, lines: int = 20) -> str:
        if not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start(
    dump: Path,
    name: str,
    args: Sequence[str],
    *,
    replica: tuple[int, int, str] | None = None,
) -> TrainProcess:
    """Start ``ttnpu-train`` in ``dump/name``; ``replica=(id, replicas, lighthouse)`` makes it
    a replica group that commits with at least one other (``min_replicas`` 1)."""
    dump.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--dump_folder", str(dump),
           "--run-name", name, *SMALL, *args]  # fmt: skip
    if replica is not None:
        replica_id, replicas, address = replica
        cmd += replica_args(replica_id, replicas, 1, address)
    log = dump / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=environment(), stdout=out, stderr=subprocess.STDOUT)
    return TrainProcess(name=name, folder=dump / name, proc=proc, log=log)


def run_all(processes: Sequence[TrainProcess], timeout: float) -> list[int]:
    """Wait for every process; a failure names the process and shows the end of its log."""
    try:
        codes = [p.wait(timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, code in zip(processes, codes, strict=True):
        if code != 0:
            raise DrillError(f"{p.name} exited with status {code}:\n{p.tail()}")
    return codes


def wait_for(
    what: str,
    condition: Callable[[], T | None],
    watched: Sequence[TrainProcess],
    timeout: float = 300,
) -> T:
    """Poll ``condition`` until it returns something truthy; a watched process that exits, or
    the deadline, raises :class:`DrillError`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        for p in watched:
            if not p.alive():
                raise DrillError(
                    f"{p.name} exited ({p.proc.returncode}) while waiting for {what}:\n{p.tail()}"
                )
        time.sleep(0.2)
    raise DrillError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextmanager
def lighthouse() -> Iterator[str]:
    """A Lighthouse for replica groups that may die: a dead one is noticed within a second, a
    replacement has 30 s to join. Yields its address."""
    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=1000
    ) as lh:
        yield lh.address


def model_weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torchtitan DCP checkpoint (keys ``model.*``)."""
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    out.unlink()
    return {k: v for k, v in state.items() if k.startswith("model.")}


def lost_steps(processes: list[TrainProcess], last: int) -> list[int]:
    """Committed steps lost by a replica group whose processes are ``processes`` (killed ones
    and their replacements): steps 1..last that none of them committed, then steps one of them
    committed twice (redone after a fault)."""
    committed: set[int] = set()
    twice = []
    for p in processes:
        done = [r["step"] for r in p.steps()]
        twice += [s for s in set(done) if done.count(s) > 1]
        committed |= set(done)
    return sorted(set(range(1, last + 1)) - committed) + sorted(twice)
