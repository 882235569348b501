"""The trainer under real faults: real ``ttnpu-train`` processes, a real torchft Lighthouse.

Two replica groups of the debug DeepSeek-V4 on gloo. A replica is killed with SIGKILL and a new
process rejoins; a bit flip is injected into one replica's matmul (once, or on every attempt);
the weights are corrupted to make the loss spike. The tests read each replica's ``steps.jsonl``,
``sdc_events.jsonl`` and final checkpoints.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ttnpu.ft import EmbeddedLighthouse
from ttnpu.trainer.features import EXIT_PERSISTENT_SDC
from ttnpu.trainer.launcher import replica_args
from ttnpu.trainer.steplog import read_step_log

pytestmark = pytest.mark.e2e

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    "OMP_NUM_THREADS": "1",
    "RUST_LOG": "warn",
}


def train(run: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """``ttnpu-train`` to completion (stdout and stderr kept for the failure message)."""
    cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--dump_folder", str(run.parent),
           "--run-name", run.name, *SMALL, *args]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def steps(folder: Path) -> list[dict[str, Any]]:
    return [r for r in read_step_log(folder / "steps.jsonl") if "event" not in r]


def events(folder: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_step_log(folder / "steps.jsonl") if r.get("event") == kind]


def model_weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torchtitan DCP checkpoint."""
    out = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.startswith("model.")}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


TWO_REPLICAS = ["--replicas", "2", "--min-replicas", "2", "--training.steps", "5",
                "--checkpoint.interval", "5", "--sdc.checksums", "always"]  # fmt: skip


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two replica groups, five steps, no fault: the reference of the SDC and FSDP tests."""
    run = tmp_path_factory.mktemp("reference") / "clean"
    done = train(run, *TWO_REPLICAS)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_a_transient_sdc_is_vetoed_everywhere_and_the_rerun_matches_a_clean_run(
    tmp_path: Path, clean_run: Path
) -> None:
    common = TWO_REPLICAS
    weights_of = {"clean": clean_run, "faulty": tmp_path / "faulty"}
    faulty = train(
        tmp_path / "faulty", *common, "--sdc.inject_step", "3", "--sdc.inject_replica", "1"
    )
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    for i in range(2):
        folder = tmp_path / "faulty" / f"replica_{i}"
        [discarded] = events(folder, "discarded")
        assert discarded["step"] == 3 and discarded["attempt"] == 1 and discarded["vetoed"]
        # only the replica that was hit detected it; the other obeyed its veto
        assert discarded["sdc_events"] == (1 if i == 1 else 0)
        assert [r["attempts"] for r in steps(folder)] == [1, 1, 2, 1, 1]
    # the LR schedule did not move on the discarded attempt: same rates, step by step
    lrs = {
        name: [r["lr/AdamW"] for r in steps(run / "replica_1")] for name, run in weights_of.items()
    }
    assert lrs["faulty"] == lrs["clean"]
    caught = read_step_log(tmp_path / "faulty" / "replica_1" / "sdc_events.jsonl")
    assert [(e["kind"], e["step"], e["confirmed"]) for e in caught] == [("matmul", 3, True)]
    weights = {
        (name, i): model_weights(run / f"replica_{i}" / "checkpoint" / "step-5", tmp_path)
        for name, run in weights_of.items()
        for i in range(2)
    }
    assert_same_weights(weights["faulty", 0], weights["faulty", 1])
    assert_same_weights(weights["faulty", 1], weights["clean", 1])


def test_a_corrupted_gradient_all_reduce_is_vetoed_and_the_rerun_matches_a_clean_run(
    tmp_path: Path, clean_run: Path
) -> None:
    """A bit flip in the gradients replica 1 receives from the cross-replica all-reduce: its
    checksums do not match, both replicas discard step 3, the re-run commits clean."""
    run = tmp_path / "faulty"
    done = train(
        run, *TWO_REPLICAS, "--sdc.inject_step", "3", "--sdc.inject_replica", "1",
        "--sdc.inject_kind", "allreduce",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for i in range(2):
        [discarded] = events(run / f"replica_{i}", "discarded")
        assert (discarded["step"], discarded["vetoed"]) == (3, True)
        assert discarded["sdc_events"] == (1 if i == 1 else 0)
    caught = read_step_log(run / "replica_1" / "sdc_events.jsonl")
    assert [(e["kind"], e["step"], e["confirmed"]) for e in caught] == [("collective", 3, True)]
    assert_same_weights(
        model_weights(run / "replica_0" / "checkpoint" / "step-5", tmp_path),
        model_weights(clean_run / "replica_0" / "checkpoint" / "step-5", tmp_path),
    )


def test_fsdp_and_expert_parallel_in_one_group_train_like_two_replica_groups(
    tmp_path: Path, clean_run: Path
) -> None:
    """The same two data shards, once as two torchft replica groups (gradients averaged by
    ttnpu-ft) and once as one group of two ranks (FSDP2 + EP through torchtitan's build path):
    the same losses and gradient norms, step by step."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(port), "-m", "ttnpu.trainer.cli",
           "--dump_folder", str(tmp_path), "--run-name", "fsdp", *SMALL,
           "--training.steps", "5", "--checkpoint.interval", "5",
           "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.expert_parallel_degree", "2"]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded, replicated = steps(tmp_path / "fsdp"), steps(clean_run / "replica_0")
    assert [r["step"] for r in sharded] == [r["step"] for r in replicated] == [1, 2, 3, 4, 5]
    # The losses agree to 1e-5 at every step. The gradient norms agree as closely until the two
    # reduction orders part at a step whose norm is sensitive: on an AVX2-only host step 4 (a
    # norm 5x its neighbours') gave 26.90 against 26.87 and step 5 2.999 against 2.993, the losses
    # still equal to 6e-6 (a near-tie of the MoE router flipping is the likely cause, not pinned
    # down): the losses are the tight check, the norms are held to 1e-2.
    for a, b in zip(sharded, replicated, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2)


def test_shared_checkpoints_are_written_once_and_a_resume_restores_each_groups_data(
    tmp_path: Path, clean_run: Path
) -> None:
    """``--fault_tolerance.checkpoint_folder ../checkpoint``: the groups share one folder, each
    step's model and optimizer written once, each group's data position beside it. Resumed from
    step 3, both groups end at step 5 with the weights of the clean per-group run, bit for bit:
    each went on with its own data shard (a group given the other's would train on other
    batches)."""
    run = tmp_path / "shared"
    shared = [*TWO_REPLICAS, "--checkpoint.interval", "3",
              "--fault_tolerance.checkpoint_folder", "../checkpoint"]  # fmt: skip
    done = train(run, *shared)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = run / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [
        "ft-replica-0", "ft-replica-1", "step-3", "step-5"]  # fmt: skip
    for i in range(2):
        assert sorted(p.name for p in (folder / f"ft-replica-{i}").iterdir()) == [
            "step-3", "step-5"]  # fmt: skip
        assert not list((run / f"replica_{i}").glob("checkpoint/step-*"))
    clean = model_weights(clean_run / "replica_0" / "checkpoint" / "step-5", tmp_path)
    assert_same_weights(model_weights(folder / "step-5", tmp_path), clean)

    for path in (folder / "step-5", *folder.glob("ft-replica-*/step-5")):
        shutil.rmtree(path)  # step 3 is now the newest: resume there
    resumed = train(run, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for i in range(2):
        [_, start] = events(run / f"replica_{i}", "start")
        assert start["step"] == 3
        assert not events(run / f"replica_{i}", "data_catch_up")  # its own position loaded
    assert_same_weights(model_weights(folder / "step-5", tmp_path), clean)


def test_a_persistent_sdc_takes_the_replica_out_and_the_other_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = train(
        run, "--replicas", "2", "--min-replicas", "1", "--training.steps", "6",
        "--checkpoint.interval", "6", "--sdc.checksums", "always", "--sdc.inject_step", "3",
        "--sdc.inject_replica", "1", "--sdc.inject_persistent",
    )  # fmt: skip
    assert result.returncode == EXIT_PERSISTENT_SDC, result.stderr[-3000:]
    assert "fault is persistent" in result.stderr
    # left on purpose: torchelastic's one restart ends at once, and is not reported as one
    assert "replica 1 left the job (status 3)" in result.stdout
    assert "torchelastic restarted it" not in result.stdout
    faulty, survivor = run / "replica_1", run / "replica_0"
    assert [(e["step"], e["attempt"]) for e in events(faulty, "discarded")] == [(3, 1), (3, 2)]
    assert max(r["step"] for r in steps(faulty)) == 2  # it never committed step 3
    done = [r for r in steps(survivor) if r["step"] >= 3]
    assert [r["step"] for r in done] == [3, 4, 5, 6]
    assert all(r["participants"] == 1 for r in done)  # committed without the faulty replica
    assert (survivor / "checkpoint" / "step-6" / ".metadata").is_file()


def wait_for(what: str, cond: Callable[[], Any], procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if value := cond():
            return value
        for proc in procs:
            assert proc.poll() is None, f"a replica exited ({proc.returncode}) waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill whatever a test left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def lighthouse() -> Iterator[EmbeddedLighthouse]:
    with EmbeddedLighthouse(
        min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=1000
    ) as lh:
        yield lh


def test_a_killed_replica_leaves_the_other_training_and_a_new_one_rejoins_with_live_state(
    tmp_path: Path, lighthouse: EmbeddedLighthouse
) -> None:
    def start(i: int, name: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--dump_folder", str(tmp_path),
               "--run-name", name, *SMALL, "--training.steps", "10000",
               "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
               "--fault_tolerance.collective_timeout_seconds", "5",
               *replica_args(i, 2, 1, lighthouse.address)]  # fmt: skip
        log = (tmp_path / f"{name}.log").open("w")
        return subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    first, second = tmp_path / "r0", tmp_path / "r1"
    procs = [start(0, "r0"), start(1, "r1")]
    try:
        wait_for(
            "2 joint commits",
            lambda: [r for r in steps(second) if r["participants"] == 2][1:],
            procs,
        )
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        killed_at = max(r["step"] for r in steps(second))
        alone = wait_for(
            "the survivor to commit alone",
            lambda: [r for r in steps(first) if r["step"] > killed_at and r["participants"] == 1][
                1:
            ],
            procs[:1],
        )
        assert alone  # it went on without the dead replica
        procs[1] = start(1, "r1-rejoined")
        rejoined = tmp_path / "r1-rejoined"
        [heal] = wait_for("the heal", lambda: events(rejoined, "heal"), procs)
        assert heal["step"] > killed_at  # live state, newer than anything the dead one had
        assert heal["bytes"] > 0
        common = wait_for(
            "a checkpoint both replicas wrote after the heal",
            lambda: sorted(
                {p.parent.name for p in (first / "checkpoint").glob("step-*/ttnpu-sha256.json")}
                & {
                    p.parent.name
                    for p in (rejoined / "checkpoint").glob("step-*/ttnpu-sha256.json")
                }
            ),
            procs,
        )
        for proc in procs:
            proc.kill()
            proc.wait()
    finally:
        reap(procs)
    joint = [r for r in steps(rejoined) if r["participants"] == 2]
    assert joint and joint[0]["step"] == heal["step"] + 1
    # its data shard moved on as far as the step did (one batch a step), and the learning rate
    # it logged for its first step is the healed schedule's, the survivor's
    [catch_up] = events(rejoined, "data_catch_up")
    assert catch_up["batches"] == heal["step"]
    lrs = {r["step"]: r["lr/AdamW"] for r in steps(first)}
    assert all(lrs[r["step"]] == r["lr/AdamW"] for r in joint)
    step = common[0]
    assert_same_weights(
        model_weights(first / "checkpoint" / step, tmp_path),
        model_weights(rejoined / "checkpoint" / step, tmp_path),
    )
    # both logged the same loss for every step they committed together
    losses = {r["step"]: r["loss"] for r in steps(first)}
    assert all(losses[r["step"]] == r["loss"] for r in joint)


def test_a_replica_restarted_during_anticipatory_routing_heals_into_the_same_phase(
    tmp_path: Path,
) -> None:
    """Both replicas roll back to step 8 on the spike at 10 and route through WARMUP, ACTIVE,
    DRAIN and NORMAL; replica 1 is killed in ACTIVE and restarted from its own step-8
    checkpoint (replica 0 waits for it: min 2 replicas). The heal brings the training state
    (detector, the step anticipatory routing started from), so from its first step after the
    heal replica 1 routes in replica 0's phase and both checkpoint at the same steps, with the
    same weights."""
    spike = ["--training.steps", "20", "--checkpoint.interval", "2", "--spike.enable",
             "--spike.warmup_steps", "5", "--spike.delay_steps", "2", "--spike.active_steps", "4",
             "--fault_tolerance.quorum_timeout_seconds", "300"]  # fmt: skip

    def start(i: int, *args: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "ttnpu.trainer.cli", *args]
        with (tmp_path / f"r{i}.log").open("a") as log:
            return subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    runs = [tmp_path / "r0", tmp_path / "r1"]
    with EmbeddedLighthouse(min_replicas=2, join_timeout_ms=30_000) as lighthouse:
        procs = [
            start(i, "--dump_folder", str(tmp_path), "--run-name", f"r{i}", *SMALL, *spike,
                  "--spike.inject_step", "10", *replica_args(i, 2, 2, lighthouse.address))
            for i in range(2)
        ]  # fmt: skip
        try:
            wait_for(
                "replica 1 in ACTIVE",
                lambda: [r for r in steps(runs[1]) if r["phase"] == "active"],
                procs,
            )
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            # the restart must not plant the spike again when it heals to step 9
            procs[1] = start(1, "--resume", str(runs[1]), "--spike.inject_step", "0")
            for i, proc in enumerate(procs):
                assert proc.wait(timeout=600) == 0, (tmp_path / f"r{i}.log").read_text()[-3000:]
        finally:
            reap(procs)
    rollbacks = [events(run, "rollback")[0] for run in runs]
    for rollback in rollbacks:
        assert (rollback["onset"], rollback["detected_at"], rollback["step"]) == (10, 10, 8)
    # replica 0, never killed: the rollback's whole course
    [warmup] = events(runs[0], "warmup")
    assert warmup["step"] == 8 and warmup["captured"] == [9, 10]
    done = steps(runs[0])
    before = {r["step"]: r["loss"] for r in done if r["time"] < rollbacks[0]["time"]}
    redone = [r for r in done if r["time"] > rollbacks[0]["time"]]
    assert [r["step"] for r in redone] == list(range(9, 21))
    assert [r["phase"] for r in redone] == ["active"] * 4 + ["drain"] * 2 + ["normal"] * 6
    assert before[10] > 2 * before[9]
    # step 9 re-trained from the step-8 checkpoint (routes computed with the same weights)
    # reproduces its first loss exactly; afterwards the loss stays on its pre-spike level
    assert redone[0]["loss"] == before[9]
    assert max(r["loss"] for r in redone) < max(before[s] for s in range(5, 10)) + 1.0
    heal = events(runs[1], "heal")[-1]  # (the first is torchft's at step 0, when both start)
    assert heal["step"] >= 9
    phases = [
        {r["step"]: r["phase"] for r in steps(run) if not r.get("superseded")} for run in runs
    ]
    after = range(heal["step"] + 2, 21)  # the first step after the heal trained on its own plan
    assert [phases[1][s] for s in after] == [phases[0][s] for s in after]
    losses = [{r["step"]: r["loss"] for r in steps(run) if not r.get("superseded")} for run in runs]
    assert [losses[1][s] for s in after] == [losses[0][s] for s in after]  # the averaged loss
    assert "active" in {phases[0][s] for s in after} | {phases[0][heal["step"] + 1]}
    saved = [{p.parent.name for p in (run / "checkpoint").glob("step-*/ttnpu-sha256.json")}
             for run in runs]  # fmt: skip
    assert saved[0] == saved[1] and "step-20" in saved[0] and "step-10" not in saved[0]
    assert_same_weights(
        model_weights(runs[0] / "checkpoint" / "step-20", tmp_path),
        model_weights(runs[1] / "checkpoint" / "step-20", tmp_path),
    )


def test_a_replacement_without_the_rollback_target_rolls_back_by_healing(tmp_path: Path) -> None:
    """Replica 1 is killed after the step-4 checkpoint and replaced by a process with an empty
    run folder (a new node), which heals from replica 0. The spike at step 8 comes before the
    replacement wrote any checkpoint: replica 0 rolls back to step 4, the replacement (no
    target; before this, ``NoRollbackTargetError`` ended it) goes back to step 0 and the start
    of its data and heals to replica 0's step 4 at the next quorum. From then on both train in
    the same routing phase on the same averaged losses and end with the same weights."""
    spike = ["--training.steps", "16", "--checkpoint.interval", "4", "--spike.enable",
             "--spike.warmup_steps", "5", "--spike.delay_steps", "2", "--spike.active_steps", "3",
             "--spike.inject_step", "8",
             "--fault_tolerance.quorum_timeout_seconds", "300"]  # fmt: skip

    def start(i: int, name: str, address: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--dump_folder", str(tmp_path),
               "--run-name", name, *SMALL, *spike, *replica_args(i, 2, 2, address)]  # fmt: skip
        with (tmp_path / f"{name}.log").open("a") as log:
            return subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    first, replacement = tmp_path / "r0", tmp_path / "r1-new"
    with EmbeddedLighthouse(min_replicas=2, join_timeout_ms=30_000) as lighthouse:
        procs = [start(0, "r0", lighthouse.address), start(1, "r1", lighthouse.address)]
        try:
            wait_for("replica 1 at step 4", lambda: steps(tmp_path / "r1")[3:], procs)
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            procs[1] = start(1, "r1-new", lighthouse.address)
            for proc, name in zip(procs, ("r0", "r1-new"), strict=True):
                assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            reap(procs)
    [rollback] = events(first, "rollback")
    assert (rollback["onset"], rollback["step"], rollback["healing"]) == (8, 4, False)
    [joined, healed] = events(replacement, "heal")
    assert joined["step"] < 8
    [gone_back] = events(replacement, "rollback")
    assert (gone_back["onset"], gone_back["step"], gone_back["healing"]) == (8, 0, True)
    assert healed["step"] == 4 and healed["time"] > gone_back["time"]
    live = [
        {r["step"]: r for r in steps(run) if not r.get("superseded")}
        for run in (first, replacement)
    ]
    # its records after step 4 were superseded by the heal back to it, then written again
    assert sorted(live[1]) == list(range(min(joined["step"], 4) + 1, 17))
    after = range(5, 17)
    assert [live[1][s]["loss"] for s in after] == [live[0][s]["loss"] for s in after]
    # the healing step trained on its own plan; from the next one it routes in replica 0's phase
    assert [live[1][s]["phase"] for s in after[1:]] == [live[0][s]["phase"] for s in after[1:]]
    assert live[0][6]["phase"] == "active"
    saved = [{p.parent.name for p in (run / "checkpoint").glob("step-*/ttnpu-sha256.json")}
             for run in (first, replacement)]  # fmt: skip
    assert saved[1] == {"step-12", "step-16"} and saved[1] <= saved[0]
    assert_same_weights(
        model_weights(first / "checkpoint" / "step-16", tmp_path),
        model_weights(replacement / "checkpoint" / "step-16", tmp_path),
    )


def test_a_spike_that_no_replica_can_roll_back_ends_before_training_on(
    tmp_path: Path, lighthouse: EmbeddedLighthouse
) -> None:
    """A fault-tolerant replica with no checkpoint before the spike waits to be healed from
    one that has; when its quorum holds no such replica it stops at its next step with one line
    instead of training on the spiked weights."""
    run = tmp_path / "alone"
    result = train(
        run, "--training.steps", "12", "--checkpoint.interval", "10", "--spike.enable",
        "--spike.warmup_steps", "5", "--spike.inject_step", "7",
        *replica_args(0, 1, 1, lighthouse.address),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [x for x in result.stderr.splitlines() if x.startswith("ttnpu-train:")]
    assert "no replica in the quorum holds a rollback target" in line
    [rollback] = events(run, "rollback")
    assert (rollback["onset"], rollback["step"], rollback["healing"]) == (7, 0, True)
    assert max(r["step"] for r in steps(run)) == 7  # nothing trained after the spike
    assert not list((run / "checkpoint").glob("step-*"))
