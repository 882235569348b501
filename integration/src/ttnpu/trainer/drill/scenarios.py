"""The drill scenarios: one function each, running real ``ttnpu-train`` processes and returning
a :class:`ScenarioResult` (figures, checks, plots). Sizes come from :class:`Sizes` (``--quick``
shortens every run); runs that two scenarios read are shared through :class:`Drill`."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ttnpu.ft import LighthouseProcess
from ttnpu.trainer.features import EXIT_LIGHTHOUSE_LOST
from ttnpu.trainer.launcher import STOP_GRACE_SECONDS
from ttnpu.trainer.steplog import read_step_log

from .result import Curve, Figure, Marker, ScenarioResult, Span
from .runner import (
    SMALL,
    TOKENS_PER_STEP,
    DrillError,
    TrainProcess,
    environment,
    lighthouse,
    lost_steps,
    model_weights,
    run_all,
    start,
    wait_for,
)

__all__ = ["SCENARIOS", "Drill", "Sizes"]

_FOREVER = ("--training.steps", "10000")
"""Kill drills run "forever" and are stopped by the drill (the LR schedule is that of a
10000-step run, the same for the fault-free baseline)."""


@dataclass(frozen=True)
class Sizes:
    """How long each drill runs (steps, kills, flips, campaign trials)."""

    ft_steps: int = 40
    kill_alone_steps: int = 5
    kill_checkpoint_interval: int = 10
    storm_kills: int = 3
    restart_kills: int = 3
    sdc_steps: int = 8
    sdc_flips: tuple[tuple[int, int], ...] = ((3, 30), (4, 27), (5, 25), (6, 23), (7, 22))
    campaign: tuple[int, int, int, int, int] = (2000, 2000, 300, 500, 500)
    """matmul trials, clean products, gradient trials, all-reduce trials, clean all-reduces."""
    spike_steps: int = 30
    kept_down_quorum_timeout: int = 30
    """Seconds the replicas of lighthouse-loss's kept-down run wait for a Lighthouse before they
    checkpoint and exit (``--fault_tolerance.quorum_timeout_seconds``; 120 by default)."""

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ft_steps=10,
            kill_alone_steps=3,
            kill_checkpoint_interval=4,
            storm_kills=1,
            restart_kills=1,
            sdc_steps=5,
            sdc_flips=((3, 30),),
            campaign=(300, 300, 40, 100, 100),
            spike_steps=16,
            kept_down_quorum_timeout=15,
        )


@dataclass
class Drill:
    """Where a drill writes (``out/runs/<scenario>/``), how long it runs, and the runs that two
    scenarios share (``ft-accuracy`` and ``ft-throughput``; ``replica-exit`` and
    ``replica-rejoin``)."""

    out: Path
    sizes: Sizes = field(default_factory=Sizes)
    seed: int = 0
    shared: dict[str, Any] = field(default_factory=dict)

    def runs(self, name: str) -> Path:
        return self.out / "runs" / name

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def _curve(label: str, records: list[dict[str, Any]]) -> Curve:
    return Curve(label, [r["step"] for r in records], [r["loss"] for r in records])


# -- fault tolerance on vs off ---------------------------------------------------------------------
def _ft_pair(drill: Drill) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same run without and with fault tolerance (one replica group and a Lighthouse),
    side by side on the same host."""
    dump = drill.runs("ft")
    args = ["--training.steps", str(drill.sizes.ft_steps), "--checkpoint.interval", "100000"]
    with lighthouse() as address:
        off = start(dump, "ft-off", args)
        on = start(dump, "ft-on", args, replica=(0, 1, address))
        run_all([off, on], timeout=900)
        drill.shared["ft_load_average"] = round(os.getloadavg()[0], 1)
    return off.steps(), on.steps()


def ft_accuracy(drill: Drill) -> ScenarioResult:
    off, on = drill.once("ft_pair", lambda: _ft_pair(drill))
    loss_off, loss_on = _losses(off), _losses(on)
    diffs = [abs(loss_on[s] - loss_off[s]) for s in loss_off if s in loss_on]
    largest = max(diffs, default=float("nan"))
    return ScenarioResult(
        name="ft-accuracy",
        summary="The same run with fault tolerance off and on (torchft, one replica group, a "
        "Lighthouse): the loss curves and their largest difference.",
        figures={
            "steps": len(diffs),
            "largest_loss_difference": largest,
            "bitwise_identical": bool(diffs) and largest == 0.0,
            "final_loss_off": off[-1]["loss"],
            "final_loss_on": on[-1]["loss"],
        },
        checks={
            "both runs committed every step": len(diffs) == drill.sizes.ft_steps,
            "loss curves agree within 1e-3": bool(diffs) and largest <= 1e-3,
        },
        plots=[
            Figure(
                "ft-accuracy",
                "Loss with fault tolerance off and on",
                "step",
                "training loss",
                [_curve("FT off", off), _curve("FT on (torchft + Lighthouse)", on)],
            )
        ],
    )


def _step_seconds(records: list[dict[str, Any]]) -> dict[int, float]:
    return {b["step"]: b["time"] - a["time"] for a, b in itertools.pairwise(records)}


def ft_throughput(drill: Drill) -> ScenarioResult:
    off, on = drill.once("ft_pair", lambda: _ft_pair(drill))
    stable_from = max(3, len(off) // 4)  # the first steps include warm-up and the other's start
    seconds = {
        name: {s: t for s, t in _step_seconds(records).items() if s > stable_from}
        for name, records in (("off", off), ("on", on))
    }
    median = {name: statistics.median(v.values()) for name, v in seconds.items()}
    tokens = {name: TOKENS_PER_STEP / m for name, m in median.items()}
    ratio = tokens["on"] / tokens["off"]
    return ScenarioResult(
        name="ft-throughput",
        summary="Tokens/s with fault tolerance on over off, from the median step time over the "
        f"stable part (steps after {stable_from}) of the two runs of ft-accuracy, which ran at "
        "the same time on the same host.",
        figures={
            "tokens_per_s_off": round(tokens["off"], 1),
            "tokens_per_s_on": round(tokens["on"], 1),
            "ratio_on_over_off": round(ratio, 3),
            "median_step_seconds_off": round(median["off"], 3),
            "median_step_seconds_on": round(median["on"], 3),
            "stable_steps": len(seconds["on"]),
            "reference_target_met": ratio >= 0.95,
            "host_load_average_1min": drill.shared.get("ft_load_average"),
        },
        checks={"throughput measured over >= 4 stable steps": len(seconds["on"]) >= 4},
        notes=[
            "Reference: a drop of less than 5% with TorchFT on (DeepSeek-V4 Flash, 128 dies). "
            "Here a step is a fraction of a second, so torchft's per-step quorum and commit "
            "round-trips weigh far more than on a cluster step; the ratio is reported as "
            "measured, not asserted. Both runs share the host (and its other load, see "
            "host_load_average_1min), so on a busy host the ratio carries that noise.",
        ],
        plots=[
            Figure(
                "ft-throughput",
                f"Throughput, FT on / off = {ratio:.2f}",
                "step",
                "tokens/s",
                [
                    Curve(f"FT {name}", list(v), [TOKENS_PER_STEP / t for t in v.values()])
                    for name, v in seconds.items()
                ],
            )
        ],
    )


# -- a replica exits, a new one rejoins ----------------------------------------------------------
def _stop_at_common_checkpoint(live: list[TrainProcess]) -> str:
    """Wait for a checkpoint both live replicas wrote, then stop them; returns its name."""

    def common() -> list[str]:
        names = [
            {p.parent.name for p in (q.folder / "checkpoint").glob("step-*/ttnpu-sha256.json")}
            for q in live
        ]
        return sorted(set.intersection(*names), key=lambda n: int(n.removeprefix("step-")))

    names = wait_for("a checkpoint both replicas wrote", common, live, timeout=600)
    for p in live:
        p.kill()
    return names[-1]


def _kill_args(drill: Drill) -> list[str]:
    return [
        *_FOREVER,
        "--checkpoint.interval",
        str(drill.sizes.kill_checkpoint_interval),
        "--fault_tolerance.collective_timeout_seconds",
        "5",
    ]


def _joint(p: TrainProcess, after: int = 0) -> list[dict[str, Any]]:
    return [r for r in p.steps() if r["participants"] == 2 and r["step"] > after]


def _joint_since(p: TrainProcess, after: int, count: int) -> list[dict[str, Any]] | None:
    done = _joint(p, after)
    return done if len(done) >= count else None


def _wait_joint(live: list[TrainProcess], after: int, count: int) -> list[dict[str, Any]]:
    """Wait until the live replicas committed ``count`` steps together after step ``after``."""
    return wait_for(
        f"{count} joint commits after step {after}",
        functools.partial(_joint_since, live[-1], after, count),
        live,
        timeout=600,
    )


def _heal_of(p: TrainProcess) -> dict[str, Any] | None:
    return next(iter(p.events("heal")), None)


def _wait_heal(newcomer: TrainProcess, live: list[TrainProcess]) -> dict[str, Any]:
    return wait_for(
        f"the heal of {newcomer.name}", functools.partial(_heal_of, newcomer), live, timeout=600
    )


@dataclass
class _Rejoin:
    first: TrainProcess
    dead: TrainProcess
    rejoined: TrainProcess
    killed_at: float
    killed_step: int
    restarted_at: float
    heal: dict[str, Any]
    checkpoint: str
    equal_tensors: int
    total_tensors: int


def _kill_and_rejoin(drill: Drill) -> _Rejoin:
    """Two replica groups; replica 1 is SIGKILLed, replica 0 trains on alone, a new process
    rejoins as replica 1 and heals from replica 0's live state; stopped at a common checkpoint."""
    dump = drill.runs("replica")
    with lighthouse() as address:
        first = start(dump, "replica0", _kill_args(drill), replica=(0, 2, address))
        second = start(dump, "replica1", _kill_args(drill), replica=(1, 2, address))
        live = [first, second]
        try:
            _wait_joint(live, 0, 3)
            second.kill()
            killed_at, killed_step = time.time(), second.last_step()
            wait_for(
                "the survivor to commit alone",
                lambda: [r for r in first.steps() if r["step"] > killed_step][
                    drill.sizes.kill_alone_steps - 1 :
                ],
                [first],
            )
            rejoined = start(dump, "replica1-rejoined", _kill_args(drill), replica=(1, 2, address))
            restarted_at = rejoined.started
            live = [first, rejoined]
            heal = _wait_heal(rejoined, live)
            checkpoint = _stop_at_common_checkpoint(live)
        finally:
            for p in live:
                p.kill()
    scratch = dump / "scratch"
    a = model_weights(first.folder / "checkpoint" / checkpoint, scratch)
    b = model_weights(rejoined.folder / "checkpoint" / checkpoint, scratch)
    equal = sum(torch.equal(a[k], b[k]) for k in a if k in b)
    return _Rejoin(
        first,
        second,
        rejoined,
        killed_at,
        killed_step,
        restarted_at,
        heal,
        checkpoint,
        equal,
        max(len(a), len(b)),
    )


def replica_exit(drill: Drill) -> ScenarioResult:
    run = drill.once("rejoin", lambda: _kill_and_rejoin(drill))
    heal_step = run.heal["step"]
    alone = [r for r in run.first.steps() if run.killed_step < r["step"] <= heal_step]
    lost = lost_steps([run.first, run.dead], run.first.last_step())
    return ScenarioResult(
        name="replica-exit",
        summary="Two replica groups; the second is killed (SIGKILL) mid-run and the first "
        "trains on alone, committing every step with one participant.",
        figures={
            "killed_after_step": run.killed_step,
            "steps_committed_alone": len(alone),
            "survivor_participants_while_alone": sorted({r["participants"] for r in alone}),
            "steps_lost": lost,
        },
        checks={
            "the survivor committed every step after the exit": [r["step"] for r in alone]
            == list(range(run.killed_step + 1, heal_step + 1)),
            "it committed alone (1 participant)": bool(alone)
            and all(r["participants"] == 1 for r in alone),
            "no committed step lost": not lost,
        },
        notes=["Shares its run with replica-rejoin: after this stretch a new process rejoins."],
        plots=[
            Figure(
                "replica-exit",
                "A replica exits; the other trains on",
                "step",
                "training loss",
                [
                    _curve(
                        "replica 0 (survivor)",
                        [r for r in run.first.steps() if r["step"] <= heal_step],
                    ),
                    _curve("replica 1 (killed)", run.dead.steps()),
                ],
                markers=[Marker(run.killed_step, "replica 1 killed")],
            )
        ],
    )


def replica_rejoin(drill: Drill) -> ScenarioResult:
    run = drill.once("rejoin", lambda: _kill_and_rejoin(drill))
    heal = run.heal
    joint = _joint(run.rejoined)
    losses = _losses(run.first.steps())
    return ScenarioResult(
        name="replica-rejoin",
        summary="After replica-exit, a new process joins as replica 1 and heals from replica "
        "0's live state (no checkpoint); both then train together.",
        figures={
            "rejoin_seconds": round(heal["time"] - run.restarted_at, 1),
            "heal_restore_seconds": heal.get("restore_seconds"),
            "heal_bytes": heal.get("bytes"),
            "healed_at_step": heal["step"],
            "joint_steps_after_heal": len(joint),
            "compared_checkpoint": run.checkpoint,
            "equal_model_tensors": f"{run.equal_tensors}/{run.total_tensors}",
        },
        checks={
            "healed to the survivor's live step": heal["step"] > run.killed_step,
            "heal moved state": (heal.get("bytes") or 0) > 0,
            "first joint step follows the heal": bool(joint)
            and joint[0]["step"] == heal["step"] + 1,
            "identical losses on joint steps": all(losses[r["step"]] == r["loss"] for r in joint),
            "bit-identical weights after the heal": run.equal_tensors == run.total_tensors > 0,
        },
        notes=[
            "rejoin_seconds: from starting the new process to its heal (process start-up "
            "included); heal_restore_seconds: the state transfer itself.",
        ],
        plots=[
            Figure(
                "replica-rejoin",
                "A replica exits and a new one rejoins",
                "step",
                "training loss",
                [
                    _curve("replica 0", run.first.steps()),
                    _curve("replica 1 (killed)", run.dead.steps()),
                    _curve("replica 1 (rejoined)", run.rejoined.steps()),
                ],
                markers=[
                    Marker(run.killed_step, "replica 1 killed"),
                    Marker(heal["step"], "healed"),
                ],
                spans=[Span(run.killed_step, heal["step"], "replica 1 absent")],
            )
        ],
    )


# -- kill storm ------------------------------------------------------------------------------------
def kill_storm(drill: Drill) -> ScenarioResult:
    """N kills of a random replica at a random step, each replaced by a new process that heals;
    then the final loss against a fault-free run of the same length started alongside."""
    dump = drill.runs("kill-storm")
    rng = random.Random(drill.seed)
    processes: list[TrainProcess] = []
    markers: list[Marker] = []
    heals: list[dict[str, Any]] = []
    victims: list[int] = []
    with lighthouse() as address, lighthouse() as baseline_address:
        base = [
            start(dump, f"baseline{i}", _kill_args(drill), replica=(i, 2, baseline_address))
            for i in range(2)
        ]
        live = [
            start(dump, f"r{i}-0", _kill_args(drill), replica=(i, 2, address)) for i in range(2)
        ]
        processes += live
        try:
            after = 0
            for kill in range(1, drill.sizes.storm_kills + 1):
                _wait_joint(live, after, rng.randint(2, 6))
                victim = rng.randrange(2)
                victims.append(victim)
                live[victim].kill()
                step = live[1 - victim].last_step()
                markers.append(Marker(step, f"kill {kill}: replica {victim}"))
                live[victim] = start(
                    dump, f"r{victim}-{kill}", _kill_args(drill), replica=(victim, 2, address)
                )
                processes.append(live[victim])
                heal = _wait_heal(live[victim], live)
                heals.append(heal)
                markers.append(Marker(heal["step"], f"replica {victim} healed"))
                after = heal["step"]
            _wait_joint(live, after, 3)
            for p in live:
                p.kill()
            last = min(p.last_step() for p in live)
            wait_for(
                f"the baseline at step {last}",
                lambda: min(p.last_step() for p in base) >= last,
                base,
                timeout=900,
            )
        finally:
            for p in [*processes, *base]:
                p.kill()
    lost = lost_steps(processes, last)
    storm_loss = {s: loss for p in processes for s, loss in _losses(p.steps()).items()}
    base_loss = _losses(base[0].steps())
    window = range(last - 9, last + 1)
    final_storm = [storm_loss[s] for s in window]
    final_base = [base_loss[s] for s in window]
    difference = statistics.fmean(final_storm) - statistics.fmean(final_base)
    noise = math.sqrt(
        (statistics.variance(final_storm) + statistics.variance(final_base)) / len(window)
    )
    return ScenarioResult(
        name="kill-storm",
        summary=f"{drill.sizes.storm_kills} SIGKILLs of a random replica group at a random "
        "step, each replaced by a new process that heals from the live one; the final loss "
        "against a fault-free two-replica run started at the same time.",
        figures={
            "kills": len(heals),
            "rejoins": len(heals),
            "killed_replicas": victims,
            "last_step": last,
            "committed_steps_lost": len(lost),
            "final_loss_storm_mean_last_10": round(statistics.fmean(final_storm), 4),
            "final_loss_fault_free_mean_last_10": round(statistics.fmean(final_base), 4),
            "final_loss_difference": round(difference, 4),
            "final_loss_difference_standard_errors": round(difference / noise, 2),
            "heal_restore_seconds": [h.get("restore_seconds") for h in heals],
        },
        checks={
            "every kill was followed by a rejoin": len(heals) == drill.sizes.storm_kills,
            "no committed step lost": not lost,
            # the mean: one batch's loss alone may pass the first's (14: 10.77 > 10.10, alone)
            "training went on (mean of the last 10 losses below the first step's)": (
                statistics.fmean(final_storm) < storm_loss[1]
            ),
        },
        notes=[
            "A step counts as lost when no process committed it or one committed it twice "
            "(a step redone after a kill).",
            "The final loss is compared, not checked: each logged loss is that of one batch "
            "(128 tokens a replica, step-to-step spread about 0.5), and the two runs train on "
            "partly different batches (a survivor trains alone on half the batch while its "
            "peer is down; a rejoined replica's shard catches up with its healed step), so only "
            "a held-out evaluation of both final models would make it a sound check. The "
            "difference is also given in standard errors of the two 10-step means.",
        ],
        plots=[
            Figure(
                "kill-storm",
                "Kill storm against a fault-free run",
                "step",
                "training loss",
                [
                    Curve("fault-free", list(base_loss), list(base_loss.values())),
                    Curve(
                        "kill storm",
                        sorted(storm_loss),
                        [storm_loss[s] for s in sorted(storm_loss)],
                    ),
                ],
                markers=markers,
            )
        ],
    )


# -- a supervised job: replicas and the Lighthouse restarted -------------------------------------
def _start_event(records: list[dict[str, Any]], restart: int) -> dict[str, Any] | None:
    return next((r for r in records if r.get("event") == "start" and r["restart"] == restart), None)


def _heal_after(records: list[dict[str, Any]], since: float) -> dict[str, Any] | None:
    return next((r for r in records if r.get("event") == "heal" and r["time"] > since), None)


@dataclass(frozen=True)
class _StopOutcome:
    stopped: list[int | None]
    last: int
    lost: list[int]
    together: bool
    equal: int
    total: int


class _SupervisedJob:
    """``ttnpu-train --replicas 2`` run as a user would (one supervisor process, its output in
    ``<dump>/<name>.log``), read through its replicas' ``steps.jsonl``."""

    def __init__(self, dump: Path, name: str, args: list[str]) -> None:
        dump.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--dump_folder", str(dump),
               "--run-name", name, "--replicas", "2", *SMALL, *args]  # fmt: skip
        self.log = dump / f"{name}.log"
        self.scratch = dump / "scratch"
        with self.log.open("wb") as out:
            popen = subprocess.Popen(cmd, env=environment(), stdout=out, stderr=subprocess.STDOUT)
        self.process = TrainProcess(name, dump / name, popen, self.log)

    def records(self, i: int) -> list[dict[str, Any]]:
        return read_step_log(self.process.folder / f"replica_{i}" / "steps.jsonl")

    def committed(self, i: int) -> list[dict[str, Any]]:
        """Replica ``i``'s committed steps of its current life (a restart supersedes later ones)."""
        return [r for r in self.records(i) if "event" not in r and not r.get("superseded")]

    def last_step(self, i: int) -> int:
        return max((r["step"] for r in self.committed(i)), default=0)

    def joint_after(self, step: int, count: int) -> bool:
        """``count`` steps after ``step`` that replica 1 committed with both replicas."""
        done = [r for r in self.committed(1) if r["participants"] == 2 and r["step"] > step]
        return len(done) >= count

    def wait_joint(self, step: int, count: int) -> None:
        wait_for(
            f"{count} joint steps after step {step}",
            functools.partial(self.joint_after, step, count),
            [self.process],
            timeout=600,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stops(self) -> list[dict[str, Any] | None]:
        """Each replica's stop event (with its checkpoint), None where there is none."""
        return [
            next((r for r in self.records(i) if r.get("event") == "stop"), None) for i in range(2)
        ]

    def lost_steps(self, last: int) -> list[int]:
        """Steps up to ``last`` that no replica committed (one that healed past a step took it
        from a replica that did), or that one replica committed twice."""
        lives = [[r["step"] for r in self.committed(i)] for i in range(2)]
        missing = set(range(1, last + 1)) - set(lives[0]) - set(lives[1])
        twice = {s for steps in lives for s in steps if steps.count(s) > 1}
        return sorted(missing | twice)

    def stop(self) -> int:
        """SIGTERM to the supervisor, as a scheduler sends it; its exit status."""
        self.process.proc.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=STOP_GRACE_SECONDS)

    def stop_outcome(self) -> _StopOutcome:
        """Where each replica stopped, the committed steps lost up to replica 0's stop, and the
        model tensors bitwise equal in both stop checkpoints when they stopped at one step."""
        stopped = [s["step"] if s else None for s in self.stops()]
        last = stopped[0] or 0
        together = stopped[0] is not None and stopped[0] == stopped[1]
        equal, total = self._equal_weights(last) if together else (0, 0)
        return _StopOutcome(stopped, last, self.lost_steps(last), together, equal, total)

    def _equal_weights(self, step: int) -> tuple[int, int]:
        weights = [
            model_weights(
                self.process.folder / f"replica_{i}" / "checkpoint" / f"step-{step}", self.scratch
            )
            for i in range(2)
        ]
        equal = sum(
            k in weights[1] and torch.equal(v, weights[1][k]) for k, v in weights[0].items()
        )
        return equal, len(weights[0])


def replica_restart(drill: Drill) -> ScenarioResult:
    """``ttnpu-train --replicas 2``: replica 1's process is SIGKILLed N times; each time
    torchelastic restarts it, it heals from replica 0 and both train on; then SIGTERM to the
    supervisor stops both at one checkpointed step."""
    kills = drill.sizes.restart_kills
    job = _SupervisedJob(
        drill.runs("replica-restart"), "job", ["--max-restarts", str(kills), *_kill_args(drill)]
    )
    killed: list[dict[str, Any]] = []
    try:
        job.wait_joint(0, 3)
        for restart in range(kills):
            victim = _start_event(job.records(1), restart)
            if victim is None:
                raise DrillError(f"replica 1 has no start event of restart {restart}")
            os.kill(victim["pid"], signal.SIGKILL)
            at, step = time.time(), job.last_step(1)
            back = wait_for(
                f"restart {restart + 1}",
                functools.partial(lambda r: _start_event(job.records(1), r), restart + 1),
                [job.process],
                timeout=600,
            )
            heal = wait_for(
                f"the heal after restart {restart + 1}",
                functools.partial(lambda t: _heal_after(job.records(1), t), back["time"]),
                [job.process],
                timeout=600,
            )
            job.wait_joint(heal["step"], 2)
            killed.append({"at": at, "step": step, "back": back, "heal": heal})
        status = job.stop()
    finally:
        job.process.kill()
    end = job.stop_outcome()
    reported = job.output().count("torchelastic restarted it")
    markers = [Marker(k["step"], f"kill {i + 1}") for i, k in enumerate(killed)]
    markers += [Marker(k["heal"]["step"], f"healed {i + 1}") for i, k in enumerate(killed)]
    return ScenarioResult(
        name="replica-restart",
        summary=f"ttnpu-train --replicas 2 --max-restarts {kills}: replica 1's process is "
        f"SIGKILLed {kills} time(s); torchelastic restarts it, it heals from replica 0 and "
        "both train on; SIGTERM to the supervisor then stops both at one checkpointed step.",
        figures={
            "kills": len(killed),
            "restarts_reported_by_the_supervisor": reported,
            "killed_after_steps": [k["step"] for k in killed],
            "restart_seconds": [round(k["back"]["time"] - k["at"], 1) for k in killed],
            "healed_at_steps": [k["heal"]["step"] for k in killed],
            "stopped_at_steps": end.stopped,
            "exit_status": status,
            "committed_steps_lost": end.lost,
            "equal_model_tensors": f"{end.equal}/{end.total}",
        },
        checks={
            "every kill was restarted and healed": len(killed) == kills,
            "the supervisor reported each restart": reported == kills,
            "the job exited 0": status == 0,
            "both replicas stopped at one step": end.together,
            "no committed step lost": not end.lost and end.last > 0,
            "bit-identical weights at the stop": end.equal == end.total > 0,
        },
        plots=[
            Figure(
                "replica-restart",
                "Replica 1 killed and restarted by torchelastic",
                "step",
                "training loss",
                [_curve("replica 0", job.committed(0)), _curve("replica 1", job.committed(1))],
                markers=markers,
                spans=[Span(k["step"], k["heal"]["step"], "replica 1 down") for k in killed],
            )
        ],
        notes=[
            "restart_seconds: from the SIGKILL to the restarted process's start in training "
            "(torchelastic notices within half a second; the rest is the new process's start-up: "
            "Python, torch and the model).",
            "Replica 1's curve shows its last life only: a restart resumes from its newest "
            "checkpoint, which marks its later records superseded, before it heals to the live "
            "step (its losses were replica 0's, averaged).",
        ],
    )


_LIGHTHOUSE_PID = re.compile(r"Lighthouse at \S+ \(pid (\d+)\)")


def _step_times(label: str, committed: list[dict[str, Any]], t0: float) -> Curve:
    return Curve(
        label, [round(r["time"] - t0, 2) for r in committed], [r["step"] for r in committed]
    )


def lighthouse_loss(drill: Drill) -> ScenarioResult:
    """SIGKILL the Lighthouse of ``ttnpu-train --replicas 2``: the supervisor restarts it on its
    address and both replicas go on (then SIGTERM stops them at one checkpointed step). SIGKILL a
    Lighthouse given by ``--lighthouse`` (nobody restarts it): after the quorum timeout each
    replica writes a checkpoint of its last committed step and exits with one line."""
    dump = drill.runs("lighthouse-loss")
    kept_down_timeout = drill.sizes.kept_down_quorum_timeout
    job = _SupervisedJob(dump, "restarted", _kill_args(drill))
    try:
        job.wait_joint(0, 3)
        found = wait_for(
            "the Lighthouse's pid",
            lambda: _LIGHTHOUSE_PID.search(job.output()),
            [job.process],
        )
        os.kill(int(found.group(1)), signal.SIGKILL)
        at, step = time.time(), max(job.last_step(0), job.last_step(1))
        job.wait_joint(step, 3)
        status = job.stop()
    finally:
        job.process.kill()
    end = job.stop_outcome()
    restarted = job.output().count("the Lighthouse died (status -9); restarted at")
    times = {r["step"]: r["time"] for r in job.committed(0)}
    intervals = {b: times[b] - times[a] for a, b in itertools.pairwise(sorted(times))}
    paused = max(range(step, step + 4), key=lambda s: intervals.get(s, 0.0))
    pause = intervals.get(paused, 0.0)
    t0 = times[min(times)]
    gap = Span(round(times[paused] - pause - t0, 1), round(times[paused] - t0, 1), "no commit")

    with LighthouseProcess(min_replicas=1, join_timeout_ms=30_000) as external:
        kept = _SupervisedJob(
            dump,
            "kept-down",
            ["--lighthouse", external.address, *_kill_args(drill),
             "--fault_tolerance.quorum_timeout_seconds", str(kept_down_timeout)],
        )  # fmt: skip
        try:
            kept.wait_joint(0, 3)
            os.kill(external.pid or 0, signal.SIGKILL)
            kept_at = time.time()
            kept_status = kept.process.wait(timeout=kept_down_timeout + STOP_GRACE_SECONDS)
            ended = time.time()
        finally:
            kept.process.kill()
    kept_stops = kept.stops()
    kept_steps = [kept.last_step(i) for i in range(2)]
    leave_lines = [
        line for line in kept.output().splitlines() if "this replica leaves the job" in line
    ]
    checkpoints = [
        s is not None and s["checkpoint"] is not None and Path(s["checkpoint"]).is_dir()
        for s in kept_stops
    ]
    return ScenarioResult(
        name="lighthouse-loss",
        summary="SIGKILL of the Lighthouse of ttnpu-train --replicas 2: the supervisor restarts "
        "it on the same address and both replicas train on; SIGTERM then stops both at one "
        "checkpointed step. SIGKILL of a Lighthouse given by --lighthouse, kept down: after "
        f"the quorum timeout ({kept_down_timeout} s) each replica checkpoints its last "
        "committed step and exits with one line.",
        figures={
            "killed_after_step": step,
            "lighthouse_restarts_reported": restarted,
            "longest_step_interval_after_the_kill_seconds": round(pause, 1),
            "discarded_attempts": sum(
                r.get("event") == "discarded" for i in range(2) for r in job.records(i)
            ),
            "median_step_interval_seconds": round(statistics.median(intervals.values()), 1),
            "stopped_at_steps": end.stopped,
            "exit_status": status,
            "committed_steps_lost": end.lost,
            "equal_model_tensors": f"{end.equal}/{end.total}",
            "kept_down_last_committed_steps": kept_steps,
            "kept_down_checkpointed_steps": [s["step"] if s else None for s in kept_stops],
            "kept_down_seconds_from_kill_to_exit": round(ended - kept_at, 1),
            "kept_down_exit_status": kept_status,
            "kept_down_exit_lines": leave_lines,
        },
        checks={
            "the supervisor restarted the Lighthouse once": restarted == 1,
            "training went on after the restart, the job exited 0": status == 0,
            "no committed step lost": not end.lost and end.last > step,
            "both replicas stopped at one step with bit-identical weights": end.together
            and end.equal == end.total > 0,
            "kept down: every replica checkpointed its last committed step": all(checkpoints)
            and [s["step"] if s else None for s in kept_stops] == kept_steps,
            "kept down: one line per replica, exit status 5": len(leave_lines) == 2
            and kept_status == EXIT_LIGHTHOUSE_LOST,
        },
        plots=[
            Figure(
                "lighthouse-loss",
                "The Lighthouse killed and restarted by the supervisor",
                "seconds since replica 0's first step",
                "committed step",
                [_step_times(f"replica {i}", job.committed(i), t0) for i in range(2)],
                markers=[Marker(round(at - t0, 1), "Lighthouse killed")],
                spans=[gap],
            )
        ],
        notes=[
            "longest_step_interval_after_the_kill_seconds: the pause the loss cost, between "
            "two committed steps of replica 0: the restart of torchft_lighthouse (about 2 s: it "
            "imports torchft) and torchft's retry of the quorum (the Manager retries about once "
            "a second for the quorum timeout, then reconfigures its process group for the new "
            "Lighthouse's quorum id). discarded_attempts: step attempts a replica discarded (a "
            "quorum of the new Lighthouse under the number of the old one, with other members: "
            "StaleProcessGroup); each was re-run. A replica that the others went ahead of "
            "healed from them.",
            "kept_down_seconds_from_kill_to_exit: the quorum timeout, a checkpoint and the "
            "process exit. The batches drawn for the step that could not start count as read "
            "in that checkpoint: a --resume continues after them.",
        ],
    )


# -- silent data corruption ---------------------------------------------------------------------
def _campaign(drill: Drill) -> dict[str, Any]:
    matmul, clean, grad, comm, comm_clean = drill.sizes.campaign
    out = drill.runs("sdc") / "campaign.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "ttnpu.sdc.campaign",
        "--matmul-trials",
        str(matmul),
        "--clean",
        str(clean),
        "--grad-trials",
        str(grad),
        "--warmup",
        "30",
        "--comm-trials",
        str(comm),
        "--comm-clean",
        str(comm_clean),
        "--max-dim",
        "512",
        "--max-macs",
        str(2**20),
        "--seed",
        str(drill.seed),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=environment())
    if not out.is_file():
        raise DrillError(f"the SDC campaign failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def sdc(drill: Drill) -> ScenarioResult:
    """Bit flips in matmul outputs during training (one per run, transient), against a clean
    run; gradient and all-reduce flips from the library's offline campaign."""
    dump = drill.runs("sdc")
    steps = drill.sizes.sdc_steps
    common = [
        "--training.steps",
        str(steps),
        "--checkpoint.interval",
        "100000",
        "--sdc.checksums",
        "always",
    ]
    flips = drill.sizes.sdc_flips
    runs = [start(dump, "clean", common)]
    for step, bit in flips:
        runs.append(
            start(
                dump,
                f"flip-step{step}-bit{bit}",
                [*common, "--sdc.inject_step", str(step), "--sdc.inject_bit", str(bit)],
            )
        )
    run_all(runs, timeout=1200)
    clean_loss = _losses(runs[0].steps())
    clean_events = _sdc_events(runs[0])
    rows = []
    for (step, bit), p in zip(flips, runs[1:], strict=True):
        done = {r["step"]: r for r in p.steps()}
        caught = any(e["step"] == step and e["sdc_events"] > 0 for e in p.events("discarded"))
        events = _sdc_events(p)
        corrupted = [s for s, r in done.items() if r["loss"] != clean_loss.get(s)]
        rows.append(
            {
                "step": step,
                "bit": bit,
                "caught": caught,
                "missed": done[step]["attempts"] == 1 and not caught,
                "committed_attempts": done[step]["attempts"],
                "false_alarms": sum(e["step"] != step for e in events),
                "committed_steps_differing_from_clean": corrupted,
            }
        )
    campaign = _campaign(drill)
    reduce = {k: v for k, v in campaign["all_reduce"].items() if isinstance(v, dict)}
    in_training = {
        "flips": len(rows),
        "caught": sum(r["caught"] for r in rows),
        "missed": sum(r["missed"] for r in rows),
        "false_alarms": len(clean_events) + sum(r["false_alarms"] for r in rows),
        "corrupted_steps_committed": sum(
            bool(r["committed_steps_differing_from_clean"]) for r in rows
        ),
    }
    offline = {
        "matmul": _tally(campaign["matmul"]),
        "gradient": _tally(campaign["gradient"]),
        **{f"all_reduce_{dtype}": _tally(v) for dtype, v in reduce.items()},
    }
    tallies = [in_training, *offline.values()]
    names = ["in training: matmul", *[f"offline: {k.replace('_', ' ')}" for k in offline]]
    categories = [
        f"{n}\n(n={t['flips']})".replace(": ", ":\n") for n, t in zip(names, tallies, strict=True)
    ]
    xs = [float(i) for i in range(len(tallies))]
    return ScenarioResult(
        name="sdc",
        summary="In training: one bit flip per run in a forward matmul output (transient), "
        "with matmul checksums always on, against a clean run of the same length. Offline "
        "(`python -m ttnpu.sdc.campaign`): flips in matmul outputs, gradients and all-reduce "
        "results.",
        figures={
            "in_training": in_training,
            "in_training_flips": rows,
            "offline": offline,
            "offline_seconds": campaign.get("seconds"),
        },
        checks={
            "every in-training flip caught and re-run": in_training["caught"] == len(rows),
            "no corrupted step committed": in_training["corrupted_steps_committed"] == 0,
            "no false alarm in training": in_training["false_alarms"] == 0,
            "offline: every must-catch flip caught": all(
                t["must_missed"] == 0 for t in offline.values()
            ),
            "offline: no false alarm": all(t["false_alarms"] == 0 for t in offline.values()),
        },
        notes=[
            "In training, the trainer injects matmul flips only; gradient and all-reduce "
            "figures come from the offline campaign of ttnpu-sdc (synthetic products, a small "
            "model's gradients, two gloo ranks), not from this training run.",
            "A committed step is corrupted when its loss differs, bit for bit, from the clean "
            "run's (training is deterministic here).",
            "Offline `must_catch`: flips large enough that the detector's own rule must catch "
            "them; smaller flips may pass by design (they stay within rounding noise).",
        ],
        plots=[
            Figure(
                "sdc-detection",
                "Bit flips: share caught, not flagged, and wrongly let through",
                "where the flips were (n: flips)",
                "share of flips",
                [
                    Curve("caught", xs, [t["caught"] / t["flips"] for t in tallies]),
                    Curve(
                        "not flagged (in training: committed unchanged; offline: too small "
                        "to matter)",
                        xs,
                        [(t["flips"] - t["caught"] - _harm(t)) / t["flips"] for t in tallies],
                    ),
                    Curve(
                        "let through though large / corrupted commit (must be 0)",
                        xs,
                        [_harm(t) / t["flips"] for t in tallies],
                    ),
                ],
                kind="bar",
                categories=categories,
            ),
            Figure(
                "sdc-loss",
                "Loss of the flipped runs against the clean run",
                "step",
                "training loss",
                [
                    _curve("clean", runs[0].steps()),
                    *[
                        _curve(f"flip bit {b} at step {s}", p.steps())
                        for (s, b), p in zip(flips, runs[1:], strict=True)
                    ],
                ],
                markers=[
                    Marker(s, f"bit {b} flipped, {'caught' if r['caught'] else 'missed'}")
                    for (s, b), r in zip(flips, rows, strict=True)
                ],
            ),
        ],
    )


def _harm(tally: dict[str, Any]) -> int:
    """Flips that should have been caught and were not (offline) or that corrupted a committed
    step (in training)."""
    return int(tally.get("must_missed", tally.get("corrupted_steps_committed", 0)))


def _sdc_events(p: TrainProcess) -> list[dict[str, Any]]:
    path = p.folder / "sdc_events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tally(t: dict[str, Any]) -> dict[str, Any]:
    """The counts of one campaign section (the gradient section names its false alarms
    ``clean_false_alarms``)."""
    keys = ("flips", "caught", "must_catch", "must_missed")
    return {
        **{k: t[k] for k in keys},
        "false_alarms": t.get("false_alarms", t.get("clean_false_alarms")),
    }


# -- loss spike ------------------------------------------------------------------------------------
_SPIKE_AT, _SPIKE_WARMUP, _INTERVAL, _DELAY, _ACTIVE = 10, 5, 2, 2, 3


def loss_spike(drill: Drill) -> ScenarioResult:
    """An injected spike (noise added to the weights before step 10), with anticipatory routing
    after the rollback and without it."""
    dump = drill.runs("loss-spike")
    common = [
        "--training.steps",
        str(drill.sizes.spike_steps),
        "--checkpoint.interval",
        str(_INTERVAL),
        "--spike.enable",
        "--spike.warmup_steps",
        str(_SPIKE_WARMUP),
        "--spike.inject_step",
        str(_SPIKE_AT),
        "--spike.delay_steps",
        str(_DELAY),
        "--spike.active_steps",
        str(_ACTIVE),
    ]
    on = start(dump, "anticipatory", common)
    off = start(dump, "live-routing", [*common, "--spike.no-anticipatory"])
    run_all([on, off], timeout=900)
    figures: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    curves, markers, spans = [], [], []
    for label, p in (("anticipatory routing", on), ("routing live", off)):
        rollbacks = p.events("rollback")
        done = p.steps()
        if not rollbacks:
            figures[label] = {"rolled_back": False}
            checks[f"{label}: spike detected and rolled back"] = False
            continue
        rollback = rollbacks[0]
        before = [r for r in done if r["time"] < rollback["time"]]
        after = [r for r in done if r["time"] > rollback["time"]]
        level = max(r["loss"] for r in before if _SPIKE_WARMUP <= r["step"] < _SPIKE_AT)
        recurred = len(rollbacks) > 1 or max(r["loss"] for r in after) > level + 1.0
        phases = [r["phase"] for r in after]
        figures[label] = {
            "onset": rollback["onset"],
            "detected_at": rollback["detected_at"],
            "rolled_back_to": rollback["step"],
            "spike_loss": _losses(before)[_SPIKE_AT],
            "pre_spike_max_loss": level,
            "max_loss_after_rollback": max(r["loss"] for r in after),
            "recurred": recurred,
            "phases_after_rollback": phases,
        }
        checks[f"{label}: spike detected and rolled back"] = (
            rollback["detected_at"] == _SPIKE_AT and rollback["step"] < rollback["onset"]
        )
        checks[f"{label}: the spiking checkpoint is gone"] = not (
            p.folder / "checkpoint" / f"step-{_SPIKE_AT}"
        ).exists()
        checks[f"{label}: trained to the end"] = done[-1]["step"] == drill.sizes.spike_steps
        if p is on:
            curves.append(_curve("first pass (spiked)", before))
            markers += [
                Marker(_SPIKE_AT, "spike injected, detected"),
                Marker(rollback["step"], "rolled back to"),
            ]
            checks["anticipatory: active, drain, then normal"] = phases[: _ACTIVE + _DELAY] == [
                "active"
            ] * _ACTIVE + ["drain"] * _DELAY and set(phases[_ACTIVE + _DELAY :]) <= {"normal"}
            checks["anticipatory: the spike does not recur"] = not recurred
            for phase in ("active", "drain"):
                steps = [r["step"] for r in after if r["phase"] == phase]
                if steps:
                    spans.append(Span(min(steps) - 0.5, max(steps) + 0.5, f"routing {phase}"))
        curves.append(_curve(f"after rollback, {label}", after))
    return ScenarioResult(
        name="loss-spike",
        summary=f"Noise added to the weights before step {_SPIKE_AT} makes the loss spike; the "
        "detector rolls back to the newest checkpoint before the onset, once with anticipatory "
        "routing (routes captured with the restored weights) and once with the routers live.",
        figures=figures,
        checks=checks,
        notes=[
            "A spike recurs when a second rollback happens or the loss after the rollback "
            "exceeds the pre-spike maximum (steps 5-9) by more than 1.0."
        ],
        plots=[
            Figure(
                "loss-spike",
                "Loss spike, rollback and anticipatory routing",
                "step",
                "training loss",
                curves,
                markers=markers,
                spans=spans,
            )
        ],
    )


SCENARIOS: dict[str, Callable[[Drill], ScenarioResult]] = {
    "ft-accuracy": ft_accuracy,
    "ft-throughput": ft_throughput,
    "replica-exit": replica_exit,
    "replica-rejoin": replica_rejoin,
    "kill-storm": kill_storm,
    "replica-restart": replica_restart,
    "lighthouse-loss": lighthouse_loss,
    "sdc": sdc,
    "loss-spike": loss_spike,
}
"""Every scenario, in the order ``ttnpu-drill all`` runs them."""
