"""Replica-consistent MoE load-balance state.

Bias-balanced MoE updates each expert's routing bias from the tokens it received. Inside one replica
torchtitan reduces the counts over its own meshes only, so two replicas see different counts, update
different biases and drift apart although every parameter is otherwise bit-identical (measured).
Summing the counters across replicas before the bias update keeps every replica's bias identical.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp
from torchft import Manager

__all__ = ["expert_counters", "pack_counts", "sum_expert_counts_across_replicas", "unpack_counts"]


def expert_counters(model: torch.nn.Module, attr: str = "tokens_per_expert") -> list[torch.Tensor]:
    """Every module's ``attr`` tensor (MoE token counters), in module order."""
    counters = []
    for module in model.modules():
        counter = getattr(module, attr, None)
        if isinstance(counter, torch.Tensor):
            counters.append(counter)
    return counters


def pack_counts(counters: list[torch.Tensor]) -> torch.Tensor:
    """The counters flattened into one float32 tensor. HCCL's all-reduce takes no float64 on
    Atlas A2/A3; float32 sums are exact up to 2**24 tokens per expert (a step's counts, summed
    over the replicas) and, beyond, the same rounded sum on every replica, so biases stay equal."""
    return torch.cat([c.detach().reshape(-1).to(torch.float32) for c in counters])


def unpack_counts(counters: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` (as :func:`pack_counts` laid it out) back into the counters, in place."""
    offset = 0
    with torch.no_grad():
        for counter in counters:
            n = counter.numel()
            counter.copy_(flat[offset : offset + n].view_as(counter).to(counter))
            offset += n


def sum_expert_counts_across_replicas(
    manager: Manager, model: torch.nn.Module, attr: str = "tokens_per_expert"
) -> int:
    """Replace every MoE token counter by its sum over the participating replicas, in place.

    One all-reduce for all counters. Call it after backward and before the optimizer's bias
    update (torchtitan runs the update as an optimizer pre-step hook). A healing replica
    contributes zeros, as torchft does for gradients. Returns the number of counters reduced.
    (:class:`~ttnpu.ft.Replica` does this inside its veto vote's all-reduce instead.)
    """
    counters = expert_counters(model, attr)
    if not counters:
        return 0
    flat = pack_counts(counters)
    manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
    unpack_counts(counters, flat)
    return len(counters)
