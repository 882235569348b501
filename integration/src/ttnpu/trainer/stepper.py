"""How one optimizer step is decided: alone, or as a torchft replica group.

The trainer hands a stepper the step's forward+backward and a pre-update hook (gradient clipping);
the stepper decides whether the update happens. :class:`LocalStepper` commits unless someone raised
a flag during the step. :class:`ReplicaStepper` is :class:`ttnpu.ft.Replica`: quorum and heal,
gradients averaged over the replicas, a veto vote, torchft's commit, and an LR scheduler that only
moves on a committed step (torchtitan's fault-tolerant trainer steps it on discarded steps too).
Either way a step that is not committed leaves the weights, the optimizer and the LR untouched
and the training site clean, so the trainer can re-run it. A stop asked of one rank (a signal) is
agreed with every rank and replica in the step's vote (``StepOutcome.stop``), so all stop after the
same committed step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

from ttnpu.ft import (
    ReductionCheck,
    Replica,
    ReplicaConfig,
    check_lighthouse,
    clean_training_site,
)

from .features import FaultTolerance

__all__ = ["LocalStepper", "ReplicaStepper", "StepOutcome", "Stepper"]


@dataclass(frozen=True)
class StepOutcome:
    committed: bool
    loss: torch.Tensor | None  # averaged over the participating replicas
    vetoed: bool = False
    recovered: bool = False
    healing: bool = False  # discarded by every replica: one healed in the step's quorum
    participants: int = 1
    stop: bool = False  # every rank and replica agreed to stop after this step
    timings: dict[str, float] = field(default_factory=dict)  # torchft's share of the step, s


class Stepper(Protocol):
    @property
    def heals(self) -> int:
        """How often this replica's state was replaced by a live peer's."""

    def raise_flag(self, reason: str) -> None:
        """Ask for the current step to be discarded (on every replica)."""

    def run(
        self, fn: Callable[[], torch.Tensor], before_update: Callable[[], None], stop: bool = False
    ) -> StepOutcome:
        """One attempt at the step; ``stop``: this rank asks for a stop after it."""

    def set_step(self, step: int) -> None:
        """The training step was loaded from a checkpoint (resume, rollback)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Around every backward of a step but the last: gradients only accumulate."""

    def close(self) -> None: ...


class LocalStepper:
    """Without torchft: the process group's ranks commit together unless any rank raised a flag,
    and stop together when any rank asked to (one MAX all-reduce of both when there are several
    ranks)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
    ) -> None:
        self.model, self.optimizers, self.lr_schedulers = model, optimizers, lr_schedulers
        self.heals = 0
        self._reasons: list[str] = []

    def raise_flag(self, reason: str) -> None:
        self._reasons.append(reason)

    def run(
        self, fn: Callable[[], torch.Tensor], before_update: Callable[[], None], stop: bool = False
    ) -> StepOutcome:
        self.optimizers.zero_grad(set_to_none=True)
        self._reasons.clear()
        loss = fn()
        flags = torch.tensor([float(bool(self._reasons)), float(stop)], device=loss.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        vetoed, agreed = (bool(f > 0) for f in flags.tolist())
        if vetoed:
            clean_training_site(self.model, (self.optimizers,))
            return StepOutcome(committed=False, loss=loss, vetoed=True, stop=agreed)
        before_update()
        self.optimizers.step()
        self.lr_schedulers.step()
        return StepOutcome(committed=True, loss=loss, stop=agreed)

    def set_step(self, step: int) -> None:
        pass

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()

    def close(self) -> None:
        pass


class ReplicaStepper:
    """This process as (one rank of) a torchft replica group, through :class:`ttnpu.ft.Replica`.

    ``train_state`` (the trainer's training state) travels with the weights, optimizer and LR
    scheduler when a rejoining replica heals from a live one; ``reduction_check`` verifies the
    gradient all-reduce. Under torchrun the group's ranks
    share the launcher's store (``MASTER_ADDR``/``MASTER_PORT``). A stop is agreed across the
    replicas in the veto vote, which joins rank r of every group only; in a group of several
    ranks one more MAX all-reduce per step over the group's own process group first makes every
    rank carry the same request into it."""

    def __init__(
        self,
        config: FaultTolerance,
        model: torch.nn.Module,
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
        *,
        train_state: Any,
        device: str,
        reduction_check: ReductionCheck | None = None,
    ) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        lighthouse = check_lighthouse(config.lighthouse or None)
        self.replica = Replica(
            ReplicaConfig(
                replica_id=config.replica_id,
                lighthouse=lighthouse,
                min_replica_size=config.min_replicas,
                device=device,
                collective_timeout=timedelta(seconds=config.collective_timeout_seconds),
                collective_timeout_steps=config.collective_timeout_steps,
                step_timeout=(
                    timedelta(seconds=config.step_timeout_seconds)
                    if config.step_timeout_seconds
                    else None
                ),
                timeout=timedelta(seconds=config.quorum_timeout_seconds),
                quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
                group_rank=int(os.environ.get("RANK", "0")),
                group_world_size=world,
                store_addr=os.environ.get("MASTER_ADDR") if world > 1 else None,
                store_port=int(os.environ["MASTER_PORT"]) if world > 1 else None,
                fingerprint_every=config.fingerprint_every_steps,
                host=config.host or None,
            ),
            model,
            optimizers,
            lr_scheduler=lr_schedulers,
            extras={"train_state": train_state},
            reduction_check=reduction_check,
        )

    def raise_flag(self, reason: str) -> None:
        self.replica.veto.raise_flag(reason)

    def run(
        self, fn: Callable[[], torch.Tensor], before_update: Callable[[], None], stop: bool = False
    ) -> StepOutcome:
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([float(stop)], device=self.replica.adapter.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = flag.item() > 0
        if stop:
            self.replica.veto.request_stop()
        # The SDC guard judges the averaged gradients and the loss after the backward: its flags
        # come after the exchange, in the second vote (which also averages the loss).
        result = self.replica.run_step(
            fn, average_output=True, late_flags=True, before_update=before_update
        )
        return StepOutcome(
            committed=result.committed,
            loss=result.output,
            vetoed=result.vetoed,
            recovered=result.recovered,
            healing=result.healing,
            participants=result.participants,
            stop=result.stop,
            timings={k: round(v, 4) for k, v in result.timings.items()},
        )

    @property
    def heals(self) -> int:
        return self.replica.heals

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the shared checkpoint of the step just committed: the
        quorum's participating rank 0. Where no quorum holds (a stop after the Lighthouse was
        lost) every group writes, and the checkpointer keeps the first copy."""
        try:
            return self.replica.manager.participating_rank() == 0
        except Exception:  # torchft re-raises the failed quorum's error, whatever its type
            return True

    def set_step(self, step: int) -> None:
        self.replica.set_step(step)

    def no_sync(self) -> AbstractContextManager[None]:
        return self.replica.no_sync()

    def close(self) -> None:
        self.replica.close()
