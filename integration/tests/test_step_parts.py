"""The parts of the trainer's step, in-process: the local stepper's commit decision, the SDC guard
around a real injected bit flip, the spike guard's weight corruption and rollback plan, the step
log."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)

from ttnpu.sdc import ChecksumSwitch, SDCEvent
from ttnpu.trainer import DeepSeekV4LM, SilentDataCorruption, SpikeRecovery, model_spec
from ttnpu.trainer.launcher import replica_args, wait_at_start_barrier
from ttnpu.trainer.run_folder import write_checksums
from ttnpu.trainer.sdc_guard import SDCGuard
from ttnpu.trainer.spikes import SpikeGuard, checkpoint_infos
from ttnpu.trainer.steplog import StepLog, read_step_log
from ttnpu.trainer.stepper import LocalStepper


def _tiny() -> tuple[torch.nn.Module, OptimizersContainer, LRSchedulersContainer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizers = OptimizersContainer(default_adamw(lr=0.1), model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10
    )
    return model, optimizers, schedulers


def test_the_local_stepper_commits_unless_a_flag_was_raised() -> None:
    model, optimizers, schedulers = _tiny()
    stepper = LocalStepper(model, optimizers, schedulers)
    before = [p.detach().clone() for p in model.parameters()]
    lr = schedulers.get_metrics()
    clipped: list[int] = []

    def vetoed() -> torch.Tensor:
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        stepper.raise_flag("a detector fired")
        return loss.detach()

    outcome = stepper.run(vetoed, lambda: clipped.append(1))
    assert not outcome.committed and outcome.vetoed and not clipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # the training site was cleaned
    assert schedulers.get_metrics() == lr  # the LR did not move

    def clean() -> torch.Tensor:
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        return loss.detach()

    outcome = stepper.run(clean, lambda: clipped.append(1))
    assert outcome.committed and clipped == [1]
    assert not torch.equal(before[0], next(model.parameters()))
    assert schedulers.get_metrics() != lr


def test_the_local_stepper_says_when_a_stop_was_asked_for() -> None:
    """One rank: the request comes back as agreed, on a committed and on a vetoed step."""
    model, optimizers, schedulers = _tiny()
    stepper = LocalStepper(model, optimizers, schedulers)

    def step(veto: bool) -> torch.Tensor:
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        if veto:
            stepper.raise_flag("a detector fired")
        return loss.detach()

    outcomes = [
        stepper.run(functools.partial(step, veto), lambda: None, stop=stop)
        for veto, stop in [(False, False), (False, True), (True, True)]
    ]
    assert [(o.committed, o.stop) for o in outcomes] == [(True, False), (True, True), (False, True)]


@functools.cache
def _lm() -> DeepSeekV4LM:
    """One debug model for every test (none of them changes it except the spike test, which
    restores it)."""
    torch.manual_seed(0)
    lm = DeepSeekV4LM(model_spec("debug").model)
    lm.init_states()
    return lm


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def _step(model: torch.nn.Module, guard: SDCGuard, step: int, attempt: int) -> list[object]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    with guard.watch(step, attempt):
        loss = model(x).square().mean()
        loss.backward()
    model.zero_grad()
    guard.after_backward(attempt, loss.detach())
    return list(guard.take_events())


def test_the_sdc_guard_catches_an_injected_flip_only_where_and_when_planned(tmp_path: Path) -> None:
    lm = _mlp()
    config = SilentDataCorruption(checksums="always", inject_step=2, inject_replica=0)
    guard = SDCGuard(config, lm, replica_id=0, events_path=tmp_path / "events.jsonl")
    assert _step(lm, guard, step=1, attempt=1) == []  # clean step, checked: nothing
    caught = _step(lm, guard, step=2, attempt=1)
    assert guard.injected == 1 and SDCGuard.corrupted(caught)  # type: ignore[arg-type]
    assert _step(lm, guard, step=2, attempt=2) == []  # transient: the re-run is clean
    logged = read_step_log(tmp_path / "events.jsonl")
    assert {e["step"] for e in logged} == {2}  # everything logged, all of it at step 2
    assert {(e["kind"], e["confirmed"]) for e in logged} >= {("matmul", True)}
    other = SDCGuard(config, lm, replica_id=1, events_path=tmp_path / "other.jsonl")
    assert _step(lm, other, step=2, attempt=1) == [] and other.injected == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_verdicts_read_per_step_veto_a_flip_unconfirmed_and_the_rerun_confirms_per_product(
    tmp_path: Path, persistent: bool
) -> None:
    lm = _mlp()
    config = SilentDataCorruption(
        checksums="always",
        checksum_verdicts="step",
        inject_step=2,
        inject_persistent=persistent,
        gradient=False,
    )
    guard = SDCGuard(config, lm, replica_id=0, events_path=tmp_path / "events.jsonl")
    assert _step(lm, guard, step=1, attempt=1) == []
    caught = [e for e in _step(lm, guard, step=2, attempt=1) if isinstance(e, SDCEvent)]
    matmul = [e for e in caught if e.kind == "matmul"]  # the loss is not finite either
    assert matmul[0].where.startswith("addmm:forward#") and not SDCGuard.corrupted(caught)
    assert all(e.detail["verdict"] == "suspect" for e in matmul)
    rerun = _step(lm, guard, step=2, attempt=2)
    assert SDCGuard.corrupted(rerun) == persistent  # type: ignore[arg-type]
    assert guard.injected == (2 if persistent else 1)


def test_a_persistent_flip_corrupts_every_attempt_and_checksums_are_forced_on_reruns(
    tmp_path: Path,
) -> None:
    lm = _mlp()
    config = SilentDataCorruption(checksums="off", inject_step=1, inject_persistent=True)
    guard = SDCGuard(config, lm, replica_id=0, events_path=tmp_path / "events.jsonl")
    first = _step(lm, guard, step=1, attempt=1)  # checksums off: the flip is not seen here
    assert not SDCGuard.corrupted(first)  # type: ignore[arg-type]
    again = _step(lm, guard, step=1, attempt=2)
    assert SDCGuard.corrupted(again) and guard.injected == 2  # type: ignore[arg-type]


def test_by_default_checksums_run_on_sampled_steps_and_catch_a_flip_there(tmp_path: Path) -> None:
    lm = _mlp()
    probe = SilentDataCorruption(gradient=False, checksum_sample_steps=0.3)
    sampled_switch = SDCGuard(probe, lm, replica_id=0, events_path=tmp_path / "p.jsonl").switch
    sampled = next(s for s in range(2, 50) if sampled_switch.step_sampled(s))
    skipped = next(s for s in range(2, 50) if not sampled_switch.step_sampled(s))
    for step, caught in ((sampled, True), (skipped, False)):
        config = SilentDataCorruption(
            gradient=False, checksum_sample_steps=0.3, inject_step=step, inject_replica=0
        )
        guard = SDCGuard(config, lm, replica_id=0, events_path=tmp_path / f"{step}.jsonl")
        assert _step(lm, guard, step=1, attempt=1) == []  # no fault: no event, sampled or not
        events = _step(lm, guard, step=step, attempt=1)
        assert guard.injected == 1 and SDCGuard.corrupted(events) is caught  # type: ignore[arg-type]


def test_a_non_finite_loss_is_an_event(tmp_path: Path) -> None:
    guard = SDCGuard(
        SilentDataCorruption(gradient=False), _mlp(), replica_id=0, events_path=tmp_path / "e.jsonl"
    )
    vetoes: list[str] = []
    guard.veto_through(vetoes.append)
    guard.after_backward(1, torch.tensor(float("nan")))
    [event] = guard.take_events()
    assert event.where == "loss" and not SDCGuard.corrupted([event])
    assert vetoes == ["SDC on replica 0: gradient at loss"]  # vetoed as it was reported


def test_the_planned_spike_corrupts_the_weights_once(tmp_path: Path) -> None:
    lm = _lm()
    guard = SpikeGuard(SpikeRecovery(inject_step=3), lm, lambda batch: None, microbatches=1)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    assert not guard.maybe_inject(2)
    assert guard.maybe_inject(3)
    changed = [k for k, v in lm.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(lm.state_dict()[k].dim() >= 2 for k in changed)
    after = {k: v.clone() for k, v in lm.state_dict().items()}
    assert not guard.maybe_inject(3)  # once: a rollback does not bring it back
    assert all(torch.equal(v, after[k]) for k, v in lm.state_dict().items())
    lm.load_state_dict(before)


def test_the_rollback_plan_reads_the_parts_from_dcp_metadata(tmp_path: Path) -> None:
    parts = {"model.w": torch.ones(2), "optimizer.s": torch.ones(2), "lr_scheduler.e": 1,
             "dataloader.d": torch.ones(1), "train_state.step": 1}  # fmt: skip
    for step in (2, 4):
        dcp.save(parts, checkpoint_id=str(tmp_path / f"step-{step}"))
        write_checksums(tmp_path / f"step-{step}")  # a rollback target must verify
    dcp.save({"model.w": torch.ones(2)}, checkpoint_id=str(tmp_path / "step-6"))  # model only
    (tmp_path / "step-8").mkdir()  # a save killed midway: no .metadata
    infos = checkpoint_infos(tmp_path)
    assert [i.step for i in infos] == [2, 4, 6]
    guard = SpikeGuard(SpikeRecovery(), _lm(), lambda batch: None, microbatches=1)
    plan = guard.plan(tmp_path, onset=7)
    assert plan.target.step == 4 and [i.step for i, _ in plan.skipped] == [6]
    plan = guard.plan(tmp_path, onset=5)
    assert plan.target.step == 4
    deleted = SpikeGuard.discard_from(tmp_path, onset=4)
    assert sorted(p.name for p in deleted) == ["step-4", "step-6"]
    assert not (tmp_path / "step-4").exists() and (tmp_path / "step-2").exists()


def test_the_step_log_keeps_complete_records_only(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    log.write(step=1, loss=2.0)
    log.write(event="heal", step=1)
    with (tmp_path / "steps.jsonl").open("a") as handle:
        handle.write('{"step": 2, "lo')  # a write cut short by a kill
    records = read_step_log(tmp_path / "steps.jsonl")
    assert [(r.get("step"), r.get("event")) for r in records] == [(1, None), (1, "heal")]
    StepLog(tmp_path / "quiet.jsonl", enabled=False).write(step=1)
    assert not (tmp_path / "quiet.jsonl").exists()


@pytest.mark.parametrize("checksums", ["always", "escalate", "off"])
def test_first_attempts_are_checked_per_setting_and_reruns_always(
    checksums: str, tmp_path: Path
) -> None:
    config = SilentDataCorruption(checksums=checksums)  # type: ignore[arg-type]
    guard = SDCGuard(config, _mlp(), replica_id=0, events_path=tmp_path / "e.jsonl")
    assert guard._checking(step=1, attempt=1) == (checksums == "always")
    assert guard._checking(step=1, attempt=2)
    default_rate = ChecksumSwitch(sample_steps=config.checksum_sample_steps)
    sampled = next(s for s in range(1, 1000) if default_rate.step_sampled(s))
    assert guard._checking(step=sampled, attempt=1) == (checksums != "off")


def test_replicas_started_together_wait_for_each_other(tmp_path: Path) -> None:
    barrier = tmp_path / ".start"
    late = threading.Timer(0.3, lambda: (barrier / "ready_1").touch())
    late.start()
    started = time.monotonic()
    wait_at_start_barrier(barrier, 0, 2, timeout=30)
    assert time.monotonic() - started >= 0.25  # it waited for replica 1
    with pytest.raises(TimeoutError, match=r"only \['ready_0', 'ready_1'\] of 3 replicas"):
        wait_at_start_barrier(barrier, 0, 3, timeout=0.2)
    assert replica_args(1, 3, 1, "http://h:1", barrier)[-2:] == [
        "--fault_tolerance.start_barrier",
        str(barrier),
    ]


def test_the_gradient_all_reduce_check_carries_the_planned_fault(tmp_path: Path) -> None:
    config = SilentDataCorruption(inject_step=2, inject_kind="allreduce", inject_replica=1)
    guard = SDCGuard(config, _mlp(), replica_id=1, events_path=tmp_path / "events.jsonl")
    check = guard.reduction_check(max_world=2)
    grads = torch.randn(5000, generator=torch.Generator().manual_seed(0))

    def reduce(step: int, attempt: int) -> bool:
        with guard.watch(step, attempt):
            pass
        checksums = check.before(grads)
        return check.after(grads.clone(), checksums, world=1)

    assert reduce(step=1, attempt=1)
    assert not reduce(step=2, attempt=1)  # the planned flip, caught
    [event] = guard.take_events()
    assert (event.kind, event.step) == ("collective", 2) and SDCGuard.corrupted([event])
    assert reduce(step=2, attempt=2) and guard.injected == 1  # transient: the re-run is clean
