"""The schedule on a small MoE: Δt = 0 is normal training bit for bit, Δt = k replays routes
computed k updates earlier, phases run in order, and a checkpoint from any phase resumes exactly."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ttnpu.routing import (
    AnticipatorySchedule,
    DataExhaustedError,
    PeekableIterator,
    Phase,
    RouteCacheError,
    RouteReplayError,
    RouterSet,
    ScheduleConfig,
)
from ttnpu.routing.testing import MarkovCorpus, TinyMoE

MICROBATCHES = 2


@dataclass
class Logged:
    step: int
    phase: Phase
    captured_at: int | None
    batches: list[torch.Tensor]
    used: list[dict[str, torch.Tensor]]
    loss: float


class Run:
    """A hand-written training loop driven by the schedule (AdamW, bias balancing, grad accum)."""

    def __init__(
        self,
        delay: int,
        active: int,
        *,
        dropout: float = 0.1,
        length: int | None = None,
        microbatches: int = MICROBATCHES,
    ) -> None:
        torch.manual_seed(0)
        self.model = TinyMoE(dropout=dropout)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.data = PeekableIterator(MarkovCorpus(batch=2, seq=9, length=length))
        self.routers = RouterSet(self.model)
        self.microbatches = microbatches
        config = ScheduleConfig(delay_steps=delay, active_steps=active, microbatches=microbatches)
        self.schedule = AnticipatorySchedule(self.routers, self.data, self.model.loss, config)
        self.log: list[Logged] = []
        self.params: dict[int, dict[str, torch.Tensor]] = {}

    def step(self) -> Logged:
        self.params[self.schedule.step] = copy.deepcopy(self.model.state_dict())
        todo = self.schedule.next_step()
        used, total = [], 0.0
        for i, batch in enumerate(todo.microbatches):
            with todo.replay(i):
                loss = self.model.loss(batch) / self.microbatches
                loss.backward()
            used.append(
                {n: self.routers.router(n).last_indices.clone() for n in self.routers.names}
            )
            total += loss.item()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.model.update_router_biases()
        self.schedule.finish_step()
        logged = Logged(todo.step, todo.phase, todo.captured_at, todo.microbatches, used, total)
        self.log.append(logged)
        return logged

    def checkpoint(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(),
                "data": self.data.state_dict(),
                "rng": torch.get_rng_state(),
            }
        )

    def restore(self, checkpoint: dict[str, Any]) -> None:
        checkpoint = copy.deepcopy(checkpoint)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.schedule.load_state_dict(checkpoint["schedule"])
        self.data.load_state_dict(checkpoint["data"])
        torch.set_rng_state(checkpoint["rng"])


def normal_training(steps: int, dropout: float, microbatches: int) -> tuple[list[float], TinyMoE]:
    """The same loop without ttnpu.routing: live routing, batches straight from the corpus."""
    torch.manual_seed(0)
    model = TinyMoE(dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    corpus = iter(MarkovCorpus(batch=2, seq=9))
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(microbatches):
            loss = model.loss(next(corpus)) / microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        model.update_router_biases()
        losses.append(total)
    return losses, model


@pytest.mark.parametrize(("dropout", "microbatches"), [(0.0, 2), (0.1, 1)])
def test_delay_zero_reproduces_normal_training_bit_for_bit(
    dropout: float, microbatches: int
) -> None:
    """With dropout the capture forward must see the RNG state of the training forward, which
    it does when it runs just before it (one micro-batch per step)."""
    expected_losses, expected = normal_training(20, dropout, microbatches)
    run = Run(delay=0, active=20, dropout=dropout, microbatches=microbatches)
    run.schedule.trigger()
    for _ in range(20):
        assert run.step().phase is Phase.ACTIVE
    assert run.schedule.phase is Phase.NORMAL
    assert [r.loss for r in run.log] == expected_losses
    for (name, a), b in zip(
        run.model.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("delay", [1, 3])
def test_routes_used_at_step_t_were_computed_delay_updates_earlier(delay: int) -> None:
    run = Run(delay=delay, active=8, dropout=0.0)
    for _ in range(2):
        run.step()
    run.schedule.trigger()
    replayed = [run.step() for _ in range(8 + delay)]
    lags = [r.step - 1 - r.captured_at for r in replayed if r.captured_at is not None]
    assert lags == [min(i, delay) for i in range(8 + delay)]
    stale_somewhere = False
    for r in replayed:
        assert r.captured_at is not None
        then, now = TinyMoE(dropout=0.0), TinyMoE(dropout=0.0)
        then.load_state_dict(run.params[r.captured_at])
        now.load_state_dict(run.params[r.step - 1])
        for batch, used in zip(r.batches, r.used, strict=True):
            computed = RouterSet(then).capture(lambda m=then, b=batch: m.loss(b))
            live = RouterSet(now).capture(lambda m=now, b=batch: m.loss(b))
            for name, indices in used.items():
                assert torch.equal(indices, computed[name]), (r.step, name)
                stale_somewhere |= not torch.equal(indices, live[name])
    assert stale_somewhere  # the replayed choice really differs from live routing
    assert [r.captured_at for r in replayed[delay:]] == [
        r.step - 1 - delay for r in replayed[delay:]
    ]


def test_phases_follow_the_reference_example() -> None:
    """Rollback to 50, Δt 2, active 3 (here: step 2): WARMUP captures 3, 4; ACTIVE trains 3..5
    while capturing 5..7; DRAIN trains 6, 7; NORMAL trains 8 with live routing."""
    run = Run(delay=2, active=3)
    run.step()
    run.step()
    assert run.schedule.checkpoint_allowed
    run.schedule.trigger()
    assert run.schedule.phase is Phase.WARMUP and not run.schedule.checkpoint_allowed
    run.schedule.warm_up()
    assert run.schedule.queued_steps == [3, 4] and run.schedule.phase is Phase.ACTIVE
    seen = []
    for _ in range(6):
        logged = run.step()
        seen.append((logged.step, logged.phase, logged.captured_at, run.schedule.queued_steps))
    assert seen == [
        (3, Phase.ACTIVE, 2, [4, 5]),
        (4, Phase.ACTIVE, 2, [5, 6]),
        (5, Phase.ACTIVE, 2, [6, 7]),
        (6, Phase.DRAIN, 3, [7]),
        (7, Phase.DRAIN, 4, []),
        (8, Phase.NORMAL, None, []),
    ]
    assert run.schedule.checkpoint_allowed and len(run.schedule.cache) == 0


TRIGGER_AT = 3


def drive(run: Run, steps: int, checkpoints: dict[str, dict[str, Any]] | None = None) -> None:
    """Train to ``steps``; a spike handler triggers anticipatory routing at step ``TRIGGER_AT``."""
    while run.schedule.step < steps:
        if run.schedule.step == TRIGGER_AT and run.schedule.phase is Phase.NORMAL:
            run.schedule.trigger()
            if checkpoints is not None:
                checkpoints["warmup-empty"] = run.checkpoint()
                run.schedule.warm_up(1)
                checkpoints["warmup-partial"] = run.checkpoint()
        run.step()
        if checkpoints is not None:
            checkpoints[f"{run.schedule.phase.value}-after-{run.schedule.step}"] = run.checkpoint()


def test_resumes_exactly_from_a_checkpoint_taken_in_any_phase() -> None:
    steps = 12
    reference, checkpoints = Run(delay=2, active=4), {}
    drive(reference, steps, checkpoints)
    assert {name.split("-")[0] for name in checkpoints} == {"normal", "warmup", "active", "drain"}
    for name, checkpoint in checkpoints.items():
        resumed = Run(delay=2, active=4)
        resumed.restore(checkpoint)
        drive(resumed, steps)
        tail = reference.log[len(reference.log) - len(resumed.log) :]
        assert [(r.step, r.phase, r.captured_at, r.loss) for r in resumed.log] == [
            (r.step, r.phase, r.captured_at, r.loss) for r in tail
        ], name
        for a, b in zip(resumed.model.parameters(), reference.model.parameters(), strict=True):
            assert torch.equal(a, b), name


def test_corrupted_or_missing_cache_entries_stop_the_step() -> None:
    run = Run(delay=2, active=4)
    run.schedule.trigger()
    run.schedule.warm_up()
    entry = run.schedule.cache._steps[1][1]["blocks.1.moe.router"].indices
    entry.view(-1)[3] ^= 2
    todo = run.schedule.next_step()
    with todo.replay(0):
        run.model.loss(todo.microbatches[0]).backward()
    with pytest.raises(
        RouteCacheError,
        match=r"step 1 micro-batch 1 is corrupted: router 'blocks.1.moe.router': checksum",
    ):
        todo.replay(1)
    with pytest.raises(
        RouteReplayError, match=r"step 1: micro-batches \[1\] were not run under replay"
    ):
        run.schedule.finish_step()

    run = Run(delay=2, active=4)
    run.schedule.trigger()
    run.schedule.warm_up()
    run.step()
    run.schedule.cache.drop(2)
    todo = run.schedule.next_step()
    with pytest.raises(RouteCacheError, match=r"no routes for step 2 \(cached steps: 3, 4\)"):
        todo.replay(0)


def test_misuse_is_refused() -> None:
    run = Run(delay=1, active=2)
    run.schedule.trigger()
    with pytest.raises(RuntimeError, match="already on"):
        run.schedule.trigger()
    todo = run.schedule.next_step()
    with pytest.raises(RuntimeError, match="step 1 was not finished"):
        run.schedule.next_step()
    with pytest.raises(RuntimeError, match="step 1 is in progress"):
        run.schedule.state_dict()
    with pytest.raises(IndexError, match=r"micro-batches 0..1"):
        todo.replay(2)
    run.schedule.abandon_step()
    assert run.schedule.phase is Phase.NORMAL and len(run.schedule.cache) == 0
    with pytest.raises(RuntimeError, match="no step in progress"):
        run.schedule.finish_step()
    with pytest.raises(ValueError, match=r"ScheduleConfig.active_steps must be >= 1"):
        ScheduleConfig(active_steps=0)


def test_a_bad_state_changes_nothing() -> None:
    run = Run(delay=2, active=4)
    run.schedule.trigger()
    run.schedule.warm_up()
    run.step()
    good = run.schedule.state_dict()
    bad_queue = copy.deepcopy(good)
    bad_queue["queue"] = bad_queue["queue"][1:]
    bad_phase = dict(copy.deepcopy(good), phase="normal")
    other_config = dict(
        copy.deepcopy(good),
        config={
            "delay_steps": 3,
            "active_steps": 4,
            "microbatches": 2,
            "stop_after_last_router": True,
        },
    )
    for bad, message in (
        (bad_queue, "do not follow step 1"),
        (bad_phase, "not a state it can be in"),
        (other_config, "saved config"),
    ):
        with pytest.raises(ValueError, match=message):
            run.schedule.load_state_dict(bad)
    assert run.schedule.state_dict()["queue"] == good["queue"]
    run.step()  # still works


def test_end_of_data_drains_then_stops() -> None:
    run = Run(delay=2, active=10, length=2 * MICROBATCHES)
    run.schedule.trigger()
    run.schedule.warm_up()
    assert run.step().phase is Phase.DRAIN  # no third step to capture: ACTIVE ends at once
    assert run.step().phase is Phase.DRAIN
    assert run.schedule.phase is Phase.NORMAL
    with pytest.raises(DataExhaustedError, match="data ended before the 2 micro-batches of step 3"):
        run.schedule.next_step()


def test_a_healed_replica_follows_the_phase_of_the_others() -> None:
    """At every step of an anticipatory stretch, a schedule that joins it (``follow``) is in the
    phase of the one that went through it, with the same steps queued, and from there on both
    move through the same phases (routes captured with the healed weights: lag 0 at first)."""
    delay, active, started_at = 2, 3, 4
    for join in range(started_at, started_at + active + delay + 2):
        reference = Run(delay=delay, active=active, dropout=0.0)
        for _ in range(started_at):
            reference.step()
        reference.schedule.trigger()
        for _ in range(join - started_at):
            reference.step()
        healed = Run(delay=delay, active=active, dropout=0.0)
        for _ in range(join * MICROBATCHES):  # the data position of step `join` (catch-up)
            next(healed.data)
        healed.schedule.step = join
        healed.schedule.follow(started_at)
        a, b = reference.schedule, healed.schedule
        assert (b.phase, b.active_left, b.queued_steps) == (a.phase, a.active_left, a.queued_steps)
        for _ in range(active + delay):
            left, right = reference.step(), healed.step()
            assert (left.step, left.phase) == (right.step, right.phase)
            assert torch.equal(left.batches[0], right.batches[0])
        assert healed.schedule.phase is Phase.NORMAL


def test_follow_refuses_a_stretch_that_starts_later() -> None:
    run = Run(delay=2, active=3)
    with pytest.raises(ValueError, match="started at step 5, after step 0"):
        run.schedule.follow(5)
