"""The rollback plan: which checkpoint to restore after a loss spike.

It works on checkpoint metadata (step and the parts a checkpoint holds), so any checkpointer can be
plugged in: the trainer lists its checkpoints (torchtitan: the DCP metadata of each ``step-N``) and
restores the step this module picks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

#: The parts a checkpoint needs for a rollback that resumes training exactly where it was.
REQUIRED_PARTS: frozenset[str] = frozenset(
    {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
)


class NoRollbackTargetError(RuntimeError):
    """No checkpoint is both complete and strictly before the spike onset."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpointer knows about one checkpoint: its step and the parts it holds."""

    step: int
    parts: frozenset[str]
    location: str = ""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"CheckpointInfo.step must be >= 0, got {self.step} ({self.location})")


@dataclass(frozen=True)
class RollbackPlan:
    """The checkpoint to restore, and every newer candidate that was passed over, with why."""

    target: CheckpointInfo
    onset: int
    skipped: tuple[tuple[CheckpointInfo, str], ...] = field(default=())


def plan_rollback(
    checkpoints: Iterable[CheckpointInfo],
    onset: int,
    *,
    required: frozenset[str] = REQUIRED_PARTS,
) -> RollbackPlan:
    """The newest checkpoint that holds every ``required`` part and was taken strictly before
    ``onset``; raises :class:`NoRollbackTargetError` (listing every candidate and why it failed)
    when there is none."""
    if onset < 1:
        raise ValueError(f"plan_rollback: onset must be >= 1, got {onset}")
    skipped: list[tuple[CheckpointInfo, str]] = []
    for info in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        if info.step >= onset:
            skipped.append((info, f"step {info.step} is not before the onset {onset}"))
        elif missing := required - info.parts:
            skipped.append((info, f"incomplete, missing {sorted(missing)}"))
        else:
            return RollbackPlan(target=info, onset=onset, skipped=tuple(skipped))
    reasons = "; ".join(
        f"step {c.step}{f' ({c.location})' if c.location else ''}: {why}" for c, why in skipped
    )
    raise NoRollbackTargetError(
        f"no checkpoint is complete ({sorted(required)}) and strictly before step {onset}"
        + (f": {reasons}" if reasons else ": there are no checkpoints")
    )
