"""``ttnpu-train --replicas N``: N replica groups on one host, around a watched Lighthouse.

Each replica group runs under torchrun's elastic agent (``torch.distributed.run --standalone
--max-restarts K``): a replica that dies is restarted by torchelastic with the same command, into
the same ``replica_<i>/`` folder, and rejoins the next quorum, healing from a live replica (the CLI
sees ``TORCHELASTIC_RESTART_COUNT`` and resumes there). The supervisor reports each restart as it
sees the new process, and the restarted replica records it in its ``steps.jsonl`` (the ``start``
event's ``restart``). A replica that leaves the job on purpose (a persistent silent data
corruption, split brain) records its exit status in ``left.json`` and is not brought back: its
restart exits 0 at once, which ends its agent, and the supervisor reports that status. On a
cluster, the same pieces run under the scheduler: ``examples/slurm/`` starts ``torchft_lighthouse``
once and each replica group under torchrun with ``--fault_tolerance.enable`` and
``--fault_tolerance.lighthouse``.

The Lighthouse is torchft's ``torchft_lighthouse``, a child process bound to a loopback port
(``ttnpu.ft.LighthouseProcess``, its output in ``<run>/lighthouse.log``), or one given by address
(``--lighthouse``), which is not watched. One that dies is restarted on the same address, up to
``max_restarts`` times; the replicas retry their quorum meanwhile and go on (no committed step is
lost). One that stays away longer than the replicas' quorum timeout makes each of them write a
checkpoint of its last committed step and leave with ``EXIT_LIGHTHOUSE_LOST``.

SIGTERM and SIGINT to the supervisor are forwarded to every replica, which agree on a step, stop
after it with a checkpoint and exit 0 (and so does its agent); replicas not gone
``STOP_GRACE_SECONDS`` later are killed. Agents and replicas run outside the terminal's process
group (a Ctrl-C reaches them once, forwarded) and the replicas watch the supervisor's pid
(``--supervisor-pid``): a supervisor that vanished (SIGKILL) leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ttnpu.ft import LighthouseProcess, LighthouseStartError

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "LEFT_FILE",
    "STOP_GRACE_SECONDS",
    "elastic_agent",
    "launch_replicas",
    "left_status",
    "record_left",
    "replica_args",
    "restart_count",
    "wait_at_start_barrier",
]

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_SECONDS = 300.0
"""How long replicas asked to stop may take (a step and a checkpoint) before they are killed."""
DEFAULT_MAX_RESTARTS = 3
"""How often torchelastic restarts a dead replica (``--max-restarts``) before it stays down."""
LEFT_FILE = "left.json"
"""In a replica's run folder: the exit status with which it left the job on purpose."""


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
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    lighthouse_address: str | None = None,
) -> int:
    """Start the Lighthouse (unless ``lighthouse_address`` names a running one) and, per entry of
    ``child_args`` (``ttnpu-train`` arguments, to which the replica overrides are appended), a
    torchrun agent restarting its replica up to ``max_restarts`` times; wait for all, reporting
    restarts (and restarting a dead Lighthouse as often) and forwarding SIGTERM and SIGINT.
    Returns 0 when every replica finished or stopped on request, else the first non-zero exit
    status."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    barrier = run / ".start"
    shutil.rmtree(barrier, ignore_errors=True)
    agents: list[subprocess.Popen[bytes]] = []
    folders = [run / f"replica_{i}" for i in range(len(child_args))]
    lighthouse = None
    if lighthouse_address is None:
        lighthouse = LighthouseProcess(
            min_replicas, join_timeout_ms=30_000, log=run / "lighthouse.log"
        ).start()
        lighthouse_address = lighthouse.address
    supervisor = _Supervisor(agents, folders, lighthouse, max_restarts)
    owned = f" (pid {lighthouse.pid})" if lighthouse is not None else ""
    print(f"ttnpu-train: Lighthouse at {lighthouse_address}{owned}", flush=True)
    try:
        for i, args in enumerate(child_args):
            cmd = [
                *elastic_agent(max_restarts), "-m", "ttnpu.trainer.cli", *args,
                "--supervisor-pid", str(os.getpid()),
                *replica_args(i, replicas, min_replicas, lighthouse_address, barrier),
            ]  # fmt: skip
            agents.append(subprocess.Popen(cmd, env=env, process_group=0))
        codes = [left_status(f) or code for f, code in zip(folders, supervisor.wait(), strict=True)]
    finally:
        supervisor.kill_all()
        supervisor.close()
        if lighthouse is not None:
            lighthouse.close()
    done = "stopped" if supervisor.signals else "finished"
    for i, code in enumerate(codes):
        state = done if code == 0 else f"exited with status {code}"
        restarts = f" after {supervisor.restarts[i]} restart(s)" if supervisor.restarts[i] else ""
        print(f"ttnpu-train: replica {i} {state}{restarts} ({run / f'replica_{i}'})", flush=True)
    return next((code for code in codes if code != 0), 0)


def elastic_agent(max_restarts: int) -> list[str]:
    """torchrun for one replica group of one rank on this host: its own rendezvous
    (``--standalone``), a dead worker restarted up to ``max_restarts`` times, checked every
    half second."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
    ]  # fmt: skip


def restart_count() -> int:
    """How often torchelastic has restarted this process (0 on a first start or without it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_left(run: Path, status: int) -> None:
    """Record in ``run`` that this replica leaves the job with ``status`` (atomically)."""
    partial = run / f".{LEFT_FILE}.{os.getpid()}"
    partial.write_text(json.dumps({"status": status}) + "\n")
    partial.replace(run / LEFT_FILE)


def left_status(run: Path) -> int | None:
    """The status the replica in ``run`` left the job with; None if it did not leave."""
    try:
        return int(json.loads((run / LEFT_FILE).read_text())["status"])
    except FileNotFoundError:
        return None


def _workers(agent: int) -> list[int]:
    """The replica processes ``agent`` started (their command line holds ``--supervisor-pid``),
    from /proc; [] where there is none. Other children of the agent (short-lived helpers it
    runs as it starts) are no replica: seen first, one was reported as a replica that
    torchelastic restarted."""
    try:
        tasks = list(Path(f"/proc/{agent}/task").iterdir())
        children = sorted(int(c) for t in tasks for c in (t / "children").read_text().split())
    except (OSError, ValueError):
        return []
    return [pid for pid in children if _is_replica(pid)]


def _is_replica(pid: int) -> bool:
    try:
        return b"\0--supervisor-pid\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # exited meanwhile
        return False


class _Supervisor:
    """Watches the agents: reports each restart of a replica (a new worker process) as it sees
    it, and forwards SIGTERM/SIGINT to every live replica (a second SIGINT to the agents too: it
    makes them exit at once, with no restart); replicas still alive ``STOP_GRACE_SECONDS``
    after the first signal are killed. A replica that left the job (``left.json`` in its folder)
    is reported once, not as restarted. A ``lighthouse`` it owns that dies is restarted on its
    address up to ``max_restarts`` times."""

    def __init__(
        self,
        agents: list[subprocess.Popen[bytes]],
        folders: list[Path],
        lighthouse: LighthouseProcess | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
    ) -> None:
        self.agents = agents
        self.folders = folders
        self.lighthouse = lighthouse
        self.max_restarts = max_restarts
        self.lighthouse_restarts = 0
        self._left: set[int] = set()
        self.signals: list[str] = []
        self.restarts: list[int] = []
        self._seen: list[list[int]] = []
        self._deadline = float("inf")
        self._previous = {
            s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def _forward(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if not self.signals:
            self._deadline = time.monotonic() + STOP_GRACE_SECONDS
            os.write(1, f"ttnpu-train: {name}: asking the replicas to stop\n".encode())
        again = bool(self.signals)
        self.signals.append(name)
        for agent in self.agents:
            if agent.poll() is None:
                workers = _workers(agent.pid)
                for pid in workers:
                    _signal(pid, signum)
                if again or not workers:  # or a replica between two lives: its agent stops it
                    agent.send_signal(signum)

    def _watch_lighthouse(self) -> None:
        lighthouse = self.lighthouse
        if lighthouse is None or (status := lighthouse.poll()) is None:
            return
        self.lighthouse = None  # unless restarted below
        if self.lighthouse_restarts >= self.max_restarts:
            print(
                f"ttnpu-train: the Lighthouse died (status {status}) after "
                f"{self.lighthouse_restarts} restart(s); not restarted: the replicas save a "
                f"checkpoint and exit if it stays away",
                flush=True,
            )
            return
        self.lighthouse_restarts += 1
        try:
            lighthouse.restart()
        except LighthouseStartError as err:
            print(f"ttnpu-train: the Lighthouse died (status {status}); {err}", flush=True)
            return
        self.lighthouse = lighthouse
        print(
            f"ttnpu-train: the Lighthouse died (status {status}); restarted at "
            f"{lighthouse.address} (pid {lighthouse.pid}, restart {self.lighthouse_restarts})",
            flush=True,
        )

    def _watch(self) -> None:
        self._watch_lighthouse()
        while len(self._seen) < len(self.agents):
            self._seen.append([])
            self.restarts.append(0)
        for i, agent in enumerate(self.agents):
            if i not in self._left and (status := left_status(self.folders[i])) is not None:
                self._left.add(i)
                print(f"ttnpu-train: replica {i} left the job (status {status})", flush=True)
            workers = _workers(agent.pid) if agent.poll() is None else []
            if not workers or workers == self._seen[i]:
                continue
            if self._seen[i] and i not in self._left:
                self.restarts[i] += 1
                print(
                    f"ttnpu-train: replica {i} died (pid {self._seen[i][0]}); torchelastic "
                    f"restarted it (pid {workers[0]}, restart {self.restarts[i]})",
                    flush=True,
                )
            self._seen[i] = workers

    def wait(self) -> list[int]:
        """Every agent's exit status, once all have exited."""
        while any(agent.poll() is None for agent in self.agents):
            self._watch()
            if time.monotonic() > self._deadline:
                print(
                    f"ttnpu-train: replicas still running {STOP_GRACE_SECONDS:.0f} s after "
                    f"{self.signals[0]}; killing them",
                    flush=True,
                )
                self.kill_all()
            time.sleep(0.2)
        return [agent.wait() for agent in self.agents]

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def kill_all(self) -> None:
        """SIGKILL every replica, then its agent (which would restart it)."""
        for agent in self.agents:
            if agent.poll() is None:
                for pid in _workers(agent.pid):
                    _signal(pid, signal.SIGKILL)
                agent.kill()
                agent.wait()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        os.kill(pid, signum)
