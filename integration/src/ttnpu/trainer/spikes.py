"""ttnpu-routing inside the trainer: the data schedule, loss-spike detection and the rollback plan.

Every step's batches come from an :class:`~ttnpu.routing.AnticipatorySchedule` over the
dataloader; in NORMAL it simply hands out the next batches and routes live. On a spike the
trainer restores the newest complete checkpoint from before the spike's onset (the plan comes
from :func:`~ttnpu.routing.plan_rollback`), deletes the checkpoints of the bad stretch and starts a
new schedule in WARMUP: expert choices are computed ``delay_steps`` updates ahead and replayed,
then DRAIN, then NORMAL again. Checkpoints are only written in NORMAL.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.tools.logging import logger

from ttnpu.routing import (
    AnticipatorySchedule,
    CheckpointInfo,
    DetectorConfig,
    LossSpikeDetector,
    NoRollbackTargetError,
    PeekableIterator,
    RollbackPlan,
    RouterSet,
    ScheduleConfig,
    plan_rollback,
)

from .features import SpikeRecovery
from .run_folder import step_of, unverified_reason

__all__ = ["ROLLBACK_PARTS", "SpikeGuard", "checkpoint_infos"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

ROLLBACK_PARTS = frozenset({"model", "optimizer", "lr_scheduler", "dataloader", "train_state"})
"""What a torchtitan checkpoint must hold to roll back to it. No RNG state: DeepSeek-V4 training
draws no random numbers after initialisation (no dropout), so the replay is exact without it."""


def checkpoint_infos(folder: Path) -> list[CheckpointInfo]:
    """Every complete ``step-N`` checkpoint under ``folder``, with the parts its DCP metadata
    holds (the first component of each key; none when the metadata is unreadable)."""
    infos = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        step = step_of(path)
        if step is None or not (path / ".metadata").is_file():
            continue
        try:
            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception:  # unpickling garbage raises anything: the plan passes it over
            keys = {}
        parts = frozenset(key.split(".", 1)[0] for key in keys)
        infos.append(CheckpointInfo(step=step, parts=parts, location=str(path)))
    return infos


class SpikeGuard:
    """The loss-spike detector, the rollback plan, the schedule factory and the planned spike."""

    def __init__(
        self,
        config: SpikeRecovery,
        model: torch.nn.Module,
        forward: Callable[[Batch], object],
        microbatches: int,
    ) -> None:
        self.config = config
        self.model = model
        self.routers = RouterSet(model)
        self.forward = forward
        self.microbatches = microbatches
        self.detector = LossSpikeDetector(
            DetectorConfig(
                warmup_steps=config.warmup_steps,
                z_threshold=config.z_threshold,
                cooldown_steps=config.cooldown_steps,
            )
        )
        self.injected = False

    def schedule(self, dataloader: Any, step: int) -> AnticipatorySchedule[Batch]:
        """A NORMAL schedule over ``dataloader`` (from its current position) at ``step``."""
        config = ScheduleConfig(
            delay_steps=self.config.delay_steps,
            active_steps=self.config.active_steps,
            microbatches=self.microbatches,
        )
        data: PeekableIterator[Batch] = PeekableIterator(dataloader)
        return AnticipatorySchedule(self.routers, data, self.forward, config, step=step)

    def observe(self, step: int, loss: float) -> int | None:
        """The onset step when ``loss`` (replica-averaged) completes a spike, else None."""
        if not self.config.enable:
            return None
        self.detector.record_optimizer_update()
        return self.detector.observe(step, loss)

    def plan(self, folder: Path, onset: int, *, allow_unverified: bool = False) -> RollbackPlan:
        """The newest checkpoint before ``onset`` that holds every rollback part and verifies
        (:mod:`~ttnpu.trainer.run_folder`; collective). Every checkpoint passed over is in
        ``skipped`` with why, and logged; none left raises ``NoRollbackTargetError`` naming all."""
        infos = checkpoint_infos(folder)
        unverified: list[tuple[CheckpointInfo, str]] = []
        while True:
            try:
                plan = plan_rollback(infos, onset, required=ROLLBACK_PARTS)
            except NoRollbackTargetError as err:
                if not unverified:
                    raise
                passed = "; ".join(f"step {i.step} ({i.location}): {why}" for i, why in unverified)
                raise NoRollbackTargetError(f"{err}; not verified: {passed}") from err
            target = Path(plan.target.location)
            if (why := unverified_reason(target, allow_unverified=allow_unverified)) is None:
                break
            unverified.append((plan.target, why))
            infos.remove(plan.target)
        skipped = sorted([*plan.skipped, *unverified], key=lambda s: s[0].step, reverse=True)
        for info, why in skipped:
            logger.warning(f"rollback: checkpoint {info.location} skipped: {why}")
        return replace(plan, skipped=tuple(skipped))

    @staticmethod
    def discard_from(folder: Path, onset: int) -> list[Path]:
        """Delete the complete checkpoints at or after the onset: they hold the spike (a later
        resume must not pick them). Returns what was deleted."""
        doomed = [Path(info.location) for info in checkpoint_infos(folder) if info.step >= onset]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return doomed

    def maybe_inject(self, step: int) -> bool:
        """Corrupt the weights before ``step`` if it is the planned one (once per process)."""
        if self.injected or step != self.config.inject_step:
            return False
        self.injected = True
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for param in self.model.parameters():
                if param.dim() < 2:
                    continue
                noise = torch.randn(param.shape, generator=generator)
                if isinstance(param, DTensor):  # every rank drew the whole noise: keep its part
                    noise = distribute_tensor(
                        noise, param.device_mesh, param.placements, src_data_rank=None
                    )
                noise = noise.to(param.device, param.dtype)
                param.add_(noise * (self.config.inject_scale * param.float().std().item()))
        return True
