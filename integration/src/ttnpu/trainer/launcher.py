"""``ttnpu-train --replicas N``: N replica groups on one host, around an embedded Lighthouse.

Each replica group is its own ``ttnpu-train`` process (one rank), training in the run folder's
``replica_<i>/`` with ``--fault_tolerance.enable``. When one dies the others go on; a restarted
one (``ttnpu-train --resume <run>/replica_<i> --fault_tolerance.lighthouse <address>``) rejoins and
heals from a live one. On a cluster, start ``torchft_lighthouse`` yourself and run each replica
group under torchrun with ``TORCHFT_LIGHTHOUSE`` set and ``--fault_tolerance.enable``.

SIGTERM and SIGINT to the supervisor are forwarded to every replica, which agree on a step, stop
after it with a checkpoint and exit 0; replicas not gone ``STOP_GRACE_SECONDS`` later are
killed. The replicas run in their own process group (a Ctrl-C in the terminal reaches them once,
forwarded) and watch the supervisor's pid (``--supervisor-pid``): a supervisor that vanished
(SIGKILL) leaves no replica behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ttnpu.ft import EmbeddedLighthouse

__all__ = ["STOP_GRACE_SECONDS", "launch_replicas", "replica_args", "wait_at_start_barrier"]

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_SECONDS = 300.0
"""How long replicas asked to stop may take (a step and a checkpoint) before they are killed."""


def replica_args(
    replica_id: int, replicas: int, min_replicas: int, lighthouse: str, barrier: Path | None = None
) -> list[str]:
    """The overrides that make a ``ttnpu-train`` process replica group ``replica_id``."""
    args = [
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id", str(replica_id),
        "--fault_tolerance.group_size", str(replicas),
        "--fault_tolerance.min_replica_size", str(min_replicas),
        "--fault_tolerance.lighthouse", lighthouse,
    ]  # fmt: skip
    if barrier is not None:
        args += ["--fault_tolerance.start_barrier", str(barrier)]
    return args


def wait_at_start_barrier(folder: Path, replica_id: int, replicas: int, timeout: float) -> None:
    """Mark this replica ready in ``folder`` and wait until all ``replicas`` are.

    Replica groups started together must meet in their first quorum: a group whose first quorum
    forms before the others are up (``min_replicas`` < N) trains alone, and groups that stop at
    the same step with different weights can never heal (torchft heals only groups behind the
    highest step). Called once the group's torchft Manager is up and heartbeating."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ready_{replica_id}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready_*"))) < replicas:
        if time.monotonic() > deadline:
            ready = sorted(p.name for p in folder.glob("ready_*"))
            raise TimeoutError(
                f"replica {replica_id}: only {ready} of {replicas} replicas were up after "
                f"{timeout:.0f} s (start barrier {folder})"
            )
        time.sleep(0.1)


def launch_replicas(
    run: Path,
    replicas: int,
    min_replicas: int,
    child_args: Sequence[Sequence[str]],
) -> int:
    """Start the Lighthouse and one process per entry of ``child_args`` (``ttnpu-train``
    arguments, to which the replica overrides are appended); wait for all, forwarding SIGTERM and
    SIGINT. Returns 0 when every replica finished or stopped on request, else the first non-zero
    exit status."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    barrier = run / ".start"
    shutil.rmtree(barrier, ignore_errors=True)
    procs: list[subprocess.Popen[bytes]] = []
    stop = _Forwarder(procs)
    with EmbeddedLighthouse(min_replicas=min_replicas, join_timeout_ms=30_000) as lighthouse:
        print(f"ttnpu-train: Lighthouse at {lighthouse.address}", flush=True)
        try:
            for i, args in enumerate(child_args):
                cmd = [
                    sys.executable, "-m", "ttnpu.trainer.cli", *args,
                    "--supervisor-pid", str(os.getpid()),
                    *replica_args(i, replicas, min_replicas, lighthouse.address, barrier),
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env, process_group=0))
            codes = stop.wait()
        finally:
            stop.kill_all()
            stop.close()
    done = "stopped" if stop.signals else "finished"
    for i, code in enumerate(codes):
        state = done if code == 0 else f"exited with status {code}"
        print(f"ttnpu-train: replica {i} {state} ({run / f'replica_{i}'})", flush=True)
    return next((code for code in codes if code != 0), 0)


class _Forwarder:
    """The supervisor's SIGTERM/SIGINT handler: each signal goes on to every live replica (a
    second SIGINT too: it makes them exit at once); replicas still alive ``STOP_GRACE_SECONDS``
    after the first are killed."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.signals: list[str] = []
        self._deadline = float("inf")
        self._previous = {
            s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def _forward(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if not self.signals:
            self._deadline = time.monotonic() + STOP_GRACE_SECONDS
            os.write(1, f"ttnpu-train: {name}: asking the replicas to stop\n".encode())
        self.signals.append(name)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def wait(self) -> list[int]:
        """Every replica's exit status, once all have exited."""
        while any(proc.poll() is None for proc in self.procs):
            if time.monotonic() > self._deadline:
                print(
                    f"ttnpu-train: replicas still running {STOP_GRACE_SECONDS:.0f} s after "
                    f"{self.signals[0]}; killing them",
                    flush=True,
                )
                self.kill_all()
            time.sleep(0.2)
        return [proc.wait() for proc in self.procs]

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
