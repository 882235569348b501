"""A bad batch spikes the loss of a small MoE: the detector finds the onset, the newest complete
checkpoint before it is restored, and training resumes with anticipatory routing."""

import copy

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

BAD_STEP = 60
PARTS = frozenset({"model", "optimizer", "dataloader", "train_state", "rng"})  # no LR scheduler


class CorpusWithBadBatch(MarkovCorpus):
    """The batch of step ``BAD_STEP`` is noise: every pass over it spikes the loss."""

    def batch_at(self, i: int) -> torch.Tensor:
        if i == BAD_STEP - 1:
            return torch.randint(self.vocab, (self.batch, self.seq))
        return super().batch_at(i)


torch.manual_seed(0)
model = TinyMoE(dropout=0.0)  # any model whose routers implement ttnpu.routing.Router
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = PeekableIterator(CorpusWithBadBatch(batch=16, seq=17))  # checkpoint `data`, not the loader
config = ScheduleConfig(delay_steps=2, active_steps=10)
schedule = AnticipatorySchedule(RouterSet(model), data, model.loss, config)
detector = LossSpikeDetector(DetectorConfig(warmup_steps=40, cooldown_steps=40))
checkpoints: dict[int, dict[str, object]] = {}  # in memory here; DCP folders in a real trainer
infos: list[CheckpointInfo] = []

while schedule.step < 80:
    todo = schedule.next_step()  # captures ahead and pops cached routes when active
    for i, batch in enumerate(todo.microbatches):
        with todo.replay(i):  # forces the cached routes (a no-op in NORMAL)
            (loss := model.loss(batch)).backward()
    optimizer.step()
    optimizer.zero_grad()
    schedule.finish_step()
    detector.record_optimizer_update()
    if todo.phase is not Phase.NORMAL:
        print(f"step {todo.step}: loss {loss.item():.3f}, {todo.phase.name}, lag {todo.lag}")
        if schedule.phase is Phase.NORMAL:
            detector.reset()  # back to live routing: fresh statistics
    normal = schedule.phase is Phase.NORMAL
    onset = detector.observe(todo.step, loss.detach()) if normal else None  # all-reduce it first
    if onset is not None:
        plan = plan_rollback(infos, onset, required=PARTS)
        where = plan.target.location
        print(
            f"step {todo.step}: loss {loss.item():.3f}, a spike from step {onset}: back to {where}"
        )
        state = copy.deepcopy(checkpoints[plan.target.step])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.load_state_dict(state["dataloader"])
        schedule.load_state_dict(state["train_state"])
        torch.set_rng_state(state["rng"])
        detector.reset()
        schedule.trigger()
    elif schedule.checkpoint_allowed and schedule.step % 10 == 0:
        checkpoints[schedule.step] = copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "dataloader": data.state_dict(),
                "train_state": schedule.state_dict(),
                "rng": torch.get_rng_state(),
            }
        )
        infos.append(CheckpointInfo(schedule.step, PARTS, location=f"step-{schedule.step}"))
print(f"step {schedule.step}: loss {loss.item():.3f}, {schedule.phase.name} again")
