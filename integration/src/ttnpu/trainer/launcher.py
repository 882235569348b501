"""``ttnpu-train --replicas N``: N replica groups on one host, around an embedded Lighthouse.

Each replica group is its own ``ttnpu-train`` process (one rank), training in the run folder's
``replica_<i>/`` with ``--fault_tolerance.enable``. When one dies the others go on; a restarted
one (``ttnpu-train --resume <run>/replica_<i> --fault_tolerance.lighthouse <address>``) rejoins and
heals from a live one. On a cluster, start ``torchft_lighthouse`` yourself and run each replica
group under torchrun with ``TORCHFT_LIGHTHOUSE`` set and ``--fault_tolerance.enable``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ttnpu.ft import EmbeddedLighthouse

__all__ = ["launch_replicas", "replica_args"]

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def replica_args(replica_id: int, replicas: int, min_replicas: int, lighthouse: str) -> list[str]:
    """The overrides that make a ``ttnpu-train`` process replica group ``replica_id``."""
    return [
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id", str(replica_id),
        "--fault_tolerance.replicas", str(replicas),
        "--fault_tolerance.min_replicas", str(min_replicas),
        "--fault_tolerance.lighthouse", lighthouse,
    ]  # fmt: skip


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
    with EmbeddedLighthouse(min_replicas=min_replicas, join_timeout_ms=30_000) as lighthouse:
        print(f"ttnpu-train: Lighthouse at {lighthouse.address}", flush=True)
        procs = []
        try:
            for i, args in enumerate(child_args):
                cmd = [
                    sys.executable, "-m", "ttnpu.trainer.cli", *args,
                    *replica_args(i, replicas, min_replicas, lighthouse.address),
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
