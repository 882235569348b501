"""The pieces together: a bad batch spikes the loss, the detector finds the onset, the plan picks
the checkpoint before it, and training resumes there with anticipatory routing until NORMAL."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ttnpu.routing import (
    AnticipatorySchedule,
    CheckpointInfo,
    DetectorConfig,
    LossSpikeDetector,
    PeekableIterator,
    Phase,
    RouterSet,
    ScheduleConfig,
    plan_rollback,
)
from ttnpu.routing.testing import MarkovCorpus, TinyMoE

BAD_STEP = 150
PARTS = frozenset({"model", "optimizer", "dataloader", "train_state", "rng"})


class CorpusWithBadBatch(MarkovCorpus):
    """The batch of step ``BAD_STEP`` is uniform noise: every pass over it spikes the loss."""

    def batch_at(self, i: int) -> torch.Tensor:
        if i == BAD_STEP - 1:
            g = torch.Generator().manual_seed(123)
            return torch.randint(self.vocab, (self.batch, self.seq), generator=g)
        return super().batch_at(i)


def test_spike_rollback_and_anticipatory_recovery() -> None:
    torch.manual_seed(0)
    model = TinyMoE(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = PeekableIterator(CorpusWithBadBatch(batch=16, seq=17))
    schedule = AnticipatorySchedule(
        RouterSet(model), data, model.loss, ScheduleConfig(delay_steps=2, active_steps=25)
    )
    detector = LossSpikeDetector(DetectorConfig(warmup_steps=100, cooldown_steps=100))
    saved: dict[int, dict[str, Any]] = {}
    infos: list[CheckpointInfo] = []
    events: list[tuple[str, int, int]] = []
    trained: list[tuple[int, Phase, int | None]] = []

    while schedule.step < 165:
        todo = schedule.next_step()
        with todo.replay(0):
            loss = model.loss(todo.microbatches[0])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_router_biases()
        schedule.finish_step()
        detector.record_optimizer_update()
        trained.append((todo.step, todo.phase, todo.lag))
        if todo.phase is not Phase.NORMAL and schedule.phase is Phase.NORMAL:
            detector.reset()
        normal = schedule.phase is Phase.NORMAL
        onset = detector.observe(todo.step, loss.detach()) if normal else None
        if onset is not None:
            plan = plan_rollback(infos, onset, required=PARTS)
            state = copy.deepcopy(saved[plan.target.step])
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            data.load_state_dict(state["dataloader"])
            schedule.load_state_dict(state["train_state"])
            torch.set_rng_state(state["rng"])
            detector.reset()
            schedule.trigger()
            events.append(("rollback", onset, plan.target.step))
        elif schedule.checkpoint_allowed and schedule.step % 10 == 0:
            saved[schedule.step] = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "dataloader": data.state_dict(),
                    "train_state": schedule.state_dict(),
                    "rng": torch.get_rng_state(),
                }
            )
            parts = PARTS - {"rng"} if schedule.step == 140 else PARTS  # one incomplete checkpoint
            infos.append(CheckpointInfo(schedule.step, parts, location=f"step-{schedule.step}"))
            events.append(("save", schedule.step, schedule.step))

    assert [e for e in events if e[0] == "rollback"] == [("rollback", BAD_STEP, 130)]
    saves = [e[1] for e in events if e[0] == "save"]
    assert saves == [*range(10, 150, 10), 160]  # none while anticipatory (steps 131..157)
    after = trained[BAD_STEP:]
    assert [s for s, _, _ in after] == list(range(131, 166))
    assert [p for _, p, _ in after[:27]] == [Phase.ACTIVE] * 25 + [Phase.DRAIN] * 2
    assert all(p is Phase.NORMAL for _, p, _ in after[27:])
    assert [lag for _, _, lag in after[:27]] == [0, 1] + [2] * 25
    # the bad batch came back at step 150, routed with the parameters of 2 updates before
    assert after[BAD_STEP - 131] == (BAD_STEP, Phase.ACTIVE, 2)
