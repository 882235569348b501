"""``ttnpu-train --replicas N``: N replica groups on one host, around an embedded Lighthouse.

Each replica group is its own ``ttnpu-train`` process (one rank), training in the run folder's
``replica_<i>/`` with ``--fault_tolerance.enable``. When one dies the others go on; a restarted
one (``ttnpu-train --resume <run>/replica_<i> --fault_tolerance.lighthouse <address>``) rejoins and
heals from a live one. On a cluster, start ``torchft_lighthouse`` yourself and run each replica
group under torchrun with ``TORCHFT_LIGHTHOUSE`` set and ``--fault_tolerance.enable``.
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

__all__ = ["launch_replicas", "replica_args", "wait_at_start_barrier"]

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    arguments, to which the replica overrides are appended); wait for all. Returns 0 when every
    replica finished, else the first non-zero exit status."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    barrier = run / ".start"
    shutil.rmtree(barrier, ignore_errors=True)
    with EmbeddedLighthouse(min_replicas=min_replicas, join_timeout_ms=30_000) as lighthouse:
        print(f"ttnpu-train: Lighthouse at {lighthouse.address}", flush=True)
        procs = []
        try:
            for i, args in enumerate(child_args):
                cmd = [
                    sys.executable, "-m", "ttnpu.trainer.cli", *args,
                    *replica_args(i, replicas, min_replicas, lighthouse.address, barrier),
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env))
            codes = [proc.wait() for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait()
    for i, code in enumerate(codes):
        state = "finished" if code == 0 else f"exited with status {code}"
        print(f"ttnpu-train: replica {i} {state} ({run / f'replica_{i}'})", flush=True)
    return next((code for code in codes if code != 0), 0)
