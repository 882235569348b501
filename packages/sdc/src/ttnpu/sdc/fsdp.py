"""FSDP2's gradient reduce-scatter, verified by chunk checksums.

FSDP2 reduce-scatters the gradients of every sharded module inside a data-parallel group. A link
or a unit that corrupts that reduction changes one rank's shard of the reduced gradient: no matmul
checksum sees it, the gradient statistics only if it is huge, and the cross-replica all-reduce
then spreads it to every replica. :class:`CheckedReduceScatter` is a comm of torch's FSDP2
protocol (``FSDPModule.set_custom_reduce_scatter``) that runs the reduce-scatter through
:class:`~ttnpu.sdc.CollectiveChecker` on the calls its ``checking`` predicate allows and plainly
on the others, so an unchecked step costs one Python call per sharded module.

``checking`` must answer alike on every rank of the group, since a checked call adds a small
collective (the checksums): base it on the step and the attempt (sampled steps, re-runs), never on
a clock. On an accelerator the verdict waits for the reduce-scatter (one host sync per sharded
module), so on checked steps it no longer overlaps the rest of the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .comm import CollectiveChecker
from .events import Reporter

__all__ = ["CheckedReduceScatter", "check_fsdp_reduce_scatter"]


class CheckedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, verified when ``checking()`` says so (SUM and AVG reductions, the
    ops FSDP2 uses for fp32 and bf16 gradients; another op is refused at its first checked call).
    ``fault`` (tests, drills) corrupts every result, before its verification where there is one,
    so a drill also shows what an unchecked step lets through. ``checks`` and ``failures`` count
    the verified calls and the corrupted ones."""

    def __init__(
        self,
        *,
        checking: Callable[[], bool] = lambda: True,
        reporter: Reporter | None = None,
        fault: Callable[[str, Tensor], None] | None = None,
    ) -> None:
        self.checking = checking
        self.reporter = reporter
        self.fault = fault
        self._checkers: dict[dist.ProcessGroup, CollectiveChecker] = {}

    @property
    def checks(self) -> int:
        return sum(c.calls for c in self._checkers.values())

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self._checkers.values())

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if async_op:
            raise ValueError("CheckedReduceScatter: async_op=True is not supported")
        if not self.checking():
            dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
            if self.fault is not None:
                self.fault("reduce_scatter_tensor", output_tensor)
            return None
        checker = self._checkers.get(group)
        if checker is None:
            checker = CollectiveChecker(group, reporter=self.reporter, fault=self.fault)
            self._checkers[group] = checker
        checker.reduce_scatter_tensor(output_tensor, input_tensor, op)
        return None


def check_fsdp_reduce_scatter(model: nn.Module, comm: CheckedReduceScatter) -> int:
    """Have every FSDP2 module of ``model`` reduce-scatter through ``comm``; returns how many."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_reduce_scatter(comm)
    return len(modules)
