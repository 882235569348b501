"""Cleaning the training site after a discarded step.

A step that is not committed leaves partial state behind: gradients, FSDP's per-iteration state,
MoE token counters and auxiliary-loss accumulators. The next step must start from what the last
committed step left. Models declare their own per-step state through a small protocol, so this
library needs no import of any model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["SiteCleanup", "StepStateOwner", "clean_training_site"]


@runtime_checkable
class StepStateOwner(Protocol):
    """A module holding state that is accumulated during a step (token counts, aux-loss sums).

    ``reset_step_state()`` must return it to what it was at the start of the step (usually zero).
    """

    def reset_step_state(self) -> None: ...


@dataclass
class SiteCleanup:
    """What was cleaned, for logs and tests."""

    grads_cleared: int = 0
    fsdp_roots_reset: int = 0
    step_state_owners_reset: int = 0
    counters_zeroed: int = 0


def clean_training_site(
    model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()
) -> SiteCleanup:
    """Drop everything a discarded step accumulated in ``model`` (and the optimizers' grads).

    - every parameter's ``.grad`` (and the optimizers' param groups, which may hold others);
    - FSDP2 roots: ``reset_iter_state()`` (pending reduce-scatters, unsharded grads);
    - modules that are ``StepStateOwner``: ``reset_step_state()``;
    - other modules with a ``tokens_per_expert`` tensor (a plain MoE counter): zeroed.
    """
    report = SiteCleanup()
    params = {id(p): p for p in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params.update({id(p): p for p in group["params"]})
    for param in params.values():
        if param.grad is not None:
            param.grad = None
            report.grads_cleared += 1
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FSDPModule) and _is_fsdp_root(module):
                module.reset_iter_state()
                report.fsdp_roots_reset += 1
            if isinstance(module, StepStateOwner):
                module.reset_step_state()
                report.step_state_owners_reset += 1
                continue
            counter = getattr(module, "tokens_per_expert", None)
            if isinstance(counter, torch.Tensor):
                counter.zero_()
                report.counters_zeroed += 1
    return report


def _is_fsdp_root(module: FSDPModule) -> bool:
    state = module._get_fsdp_state()
    return bool(getattr(state, "_is_root", False))
