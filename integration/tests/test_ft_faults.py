"""Replica faults with real processes: SIGKILL and rejoin, SIGSTOP/SIGCONT, a cross-replica veto.

Each test starts an embedded torchft Lighthouse and two ``python -m ttnpu.ft.drill`` replicas on
loopback (gloo, CPU), injects the fault by signalling a real process and reads the replicas' JSON
step logs and per-step state files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ttnpu.ft import EmbeddedLighthouse

pytestmark = pytest.mark.e2e

HEARTBEAT_MS = 1000
JOIN_TIMEOUT_MS = 60_000
STEP_SLEEP = 0.2
HOLD_AT = 4  # the killed replica blocks inside the backward of the step after this many commits


class Drill:
    """One replica process and its logs."""

    def __init__(self, replica_id: int, out: Path, lighthouse: str, go: Path, *extra: str) -> None:
        self.replica_id, self.out = replica_id, out
        out.mkdir(parents=True, exist_ok=True)
        self.join_file = out / "join"
        self.stderr = (out / f"stderr_{replica_id}.log").open("w")
        cmd = [
            sys.executable, "-m", "ttnpu.ft.drill", "--replica-id", str(replica_id),
            "--lighthouse", lighthouse, "--out", str(out), "--go-file", str(go),
            "--join-file", str(self.join_file),
            "--step-sleep", str(STEP_SLEEP), "--collective-timeout", "3", "--steps", "100000",
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.stderr, env=env)

    def has(self, event: str) -> bool:
        return any(r.get("event") == event for r in self.records())

    def records(self) -> list[dict[str, Any]]:
        path = self.out / f"replica_{self.replica_id}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if "step" in r]

    def saved(self, step: int) -> bool:
        return (self.out / f"state_{self.replica_id}_{step}.pt").exists()

    def state(self, step: int) -> dict[str, Any]:
        return torch.load(self.out / f"state_{self.replica_id}_{step}.pt", weights_only=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()

    def tail(self) -> str:
        return (self.out / f"stderr_{self.replica_id}.log").read_text()[-3000:]


def wait_until(what: str, cond: Callable[[], Any], timeout: float, drills: list[Drill]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for d in drills:
            if d.proc.poll() not in (None, 0, -signal.SIGKILL):
                pytest.fail(f"replica {d.replica_id} exited {d.proc.returncode}:\n{d.tail()}")
        time.sleep(0.05)
    tails = "\n".join(f"--- replica {d.replica_id}\n{d.tail()}" for d in drills)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{tails}")


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), "tensor differs"
        else:
            assert x == y


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[EmbeddedLighthouse, list[Drill], Path]]:
    drills: list[Drill] = []
    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS, heartbeat_timeout_ms=HEARTBEAT_MS
    ) as lighthouse:
        yield lighthouse, drills, tmp_path
        for d in drills:
            if d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()


def start_pair(
    lighthouse: EmbeddedLighthouse,
    drills: list[Drill],
    tmp: Path,
    common: tuple[str, ...] = (),
    extra0: tuple[str, ...] = (),
    extra1: tuple[str, ...] = (),
) -> tuple[Drill, Drill]:
    go = tmp / "go"
    r0 = Drill(0, tmp / "r0", lighthouse.address, go, *common, *extra0)
    r1 = Drill(1, tmp / "r1", lighthouse.address, go, *common, *extra1)
    drills += [r0, r1]
    for d in (r0, r1):
        d.join_file.touch()
    wait_until("both replicas ready", lambda: r0.has("ready") and r1.has("ready"), 120, drills)
    go.touch()
    return r0, r1


def both(record: dict[str, Any]) -> bool:
    return bool(record["participants"] == 2)


def first(records: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> Any:
    return next((r for r in records if pred(r)), None)


def test_sigkill_survivor_continues_and_restarted_replica_heals_bitwise(cluster: Any) -> None:
    lighthouse, drills, tmp = cluster
    # The survivor learns of the death from the broken connection, not from a collective timeout.
    r0, r1 = start_pair(
        lighthouse, drills, tmp, ("--collective-timeout", "10"), extra1=("--hold-at", str(HOLD_AT))
    )
    # The replacement: a fresh process (new Manager, new uuid, step 0), imported ahead of time and
    # held before it creates its Manager, because importing torch takes ~15 s on 2 busy cores.
    r1b = Drill(1, tmp / "r1b", lighthouse.address, tmp / "go")
    drills.append(r1b)
    wait_until(
        f"replica 1 blocked inside the backward after step {HOLD_AT}",
        lambda: (r1.out / "holding_1").exists(),
        60,
        drills,
    )
    last = [r for r in r1.steps() if r["committed"]][-1]
    assert last["step"] == HOLD_AT and both(last), "the step in flight must include both"
    t_kill = time.time()
    r1.proc.send_signal(signal.SIGKILL)
    r1.proc.wait()

    # Bounded far below the join timeout: the Lighthouse dropped the dead replica by heartbeat.
    resumed = wait_until(
        "the survivor's next commit",
        lambda: first([r for r in r0.steps() if r["t"] > t_kill], lambda r: r["committed"]),
        JOIN_TIMEOUT_MS / 1000 / 3,
        drills,
    )
    discarded = [r for r in r0.steps() if r["step"] == HOLD_AT and not r["committed"]]
    assert discarded, "the survivor must discard the step in flight"
    assert resumed["step"] == HOLD_AT + 1 and resumed["participants"] == 1

    wait_until("the replacement imported", lambda: r1b.has("imported"), 60, drills)
    r1b.join_file.touch()
    rejoined = wait_until(
        "the restarted replica's first commit after healing",
        lambda: first(r1b.steps(), lambda r: r["committed"] and r["heals"] >= 1),
        60,
        drills,
    )
    step = rejoined["step"]
    assert step > resumed["step"], "the rejoined replica must have received the current step"
    wait_until(f"survivor state at step {step}", lambda: r0.saved(step), 30, drills)
    assert_bitwise_equal(r0.state(step), r1b.state(step))
    after_heal = [r for r in r1b.steps() if r["committed"]]
    assert all(r["participants"] == 2 for r in after_heal)


def test_sigstop_hung_replica_is_dropped_and_heals_after_sigcont(cluster: Any) -> None:
    lighthouse, drills, tmp = cluster
    r0, r1 = start_pair(lighthouse, drills, tmp)
    wait_until(
        "replica 1 committed step 3 with both replicas",
        lambda: first(r1.steps(), lambda r: r["committed"] and r["step"] >= 3 and both(r)),
        60,
        drills,
    )  # fmt: skip
    t_stop = time.time()
    r1.proc.send_signal(signal.SIGSTOP)
    after = lambda: [r for r in r0.steps() if r["t"] > t_stop and r["committed"]]  # noqa: E731
    alone = lambda: [r for r in after() if r["participants"] == 1]  # noqa: E731
    wait_until("the survivor commits 3 steps alone", lambda: len(alone()) >= 3, 40, drills)
    # Only the step in flight may still hold both: replica 1 stopped after its ballot went out.
    assert all(r["participants"] == 1 for r in after()[1:])

    t_cont = time.time()
    r1.proc.send_signal(signal.SIGCONT)
    healed = wait_until(
        "the resumed replica heals and commits",
        lambda: first(
            [r for r in r1.steps() if r["t"] > t_cont], lambda r: r["committed"] and r["heals"] >= 1
        ),
        60,
        drills,
    )
    # Nothing the hung replica committed after resuming differs from the survivor: a commit
    # before its heal can only be the step in flight, which it had finished with replica 0.
    resumed = [r for r in r1.steps() if r["t"] > t_cont and r["committed"]]
    unhealed = [r for r in resumed if r["heals"] == 0]
    assert len(unhealed) <= 1, f"the resumed replica committed without healing: {unhealed}"
    for r in [*unhealed, healed]:
        step = r["step"]
        wait_until(f"survivor state at step {step}", lambda s=step: r0.saved(s), 30, drills)
        assert_bitwise_equal(r0.state(step), r1.state(step))


def test_veto_from_one_replica_makes_both_skip_without_heal(cluster: Any) -> None:
    lighthouse, drills, tmp = cluster
    r0, r1 = start_pair(lighthouse, drills, tmp, ("--steps", "6"), ("--veto-at", "3"))
    for d in (r0, r1):
        wait_until(f"replica {d.replica_id} done", lambda d=d: d.proc.poll() == 0, 60, drills)
    for d in (r0, r1):
        steps = d.steps()
        vetoed = [r for r in steps if r["vetoed"]]
        assert len(vetoed) == 1 and not vetoed[0]["committed"] and vetoed[0]["step"] == 3
        heals_at_veto = vetoed[0]["heals"]
        assert steps[-1]["heals"] == heals_at_veto, "no heal may follow a veto"
        assert all(r["participants"] == 2 for r in steps if r["committed"])
    for step in range(1, 7):
        assert_bitwise_equal(r0.state(step), r1.state(step))
