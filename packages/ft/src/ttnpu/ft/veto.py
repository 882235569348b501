"""A cross-replica commit veto.

torchft's ``should_commit`` is an AND over the ranks of *one* replica group: a replica that spots a
problem (an SDC event, a NaN loss) only drops its own update while the others commit a step that
already contains its gradient. The veto is one scalar MAX all-reduce through the Manager before
``should_commit``: if any replica raised a flag, every replica reports an error and skips the step,
so weights stay identical everywhere and nobody needs to heal.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed import ReduceOp
from torchft import Manager

__all__ = ["CommitVeto", "CommitVetoed"]


class CommitVetoed(RuntimeError):
    """Reported to the Manager on every replica when any replica vetoed the step."""


class CommitVeto:
    """Collects local veto reasons during a step and turns them into a cross-replica decision.

    ``raise_flag`` may be called from any thread (a detector hook, a callback); ``vote`` must be
    called by every replica once per step, after the gradient all-reduce and before
    ``should_commit``.
    """

    def __init__(self, manager: Manager, device: torch.device | str = "cpu") -> None:
        self._manager = manager
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._reasons: list[str] = []
        self.vetoed_steps = 0

    def raise_flag(self, reason: str) -> None:
        """Ask every replica to skip the current step."""
        with self._lock:
            self._reasons.append(reason)

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return list(self._reasons)

    def vote(self) -> bool:
        """MAX all-reduce of the flags; on a veto, report ``CommitVetoed``. Returns vetoed."""
        with self._lock:
            reasons, self._reasons = self._reasons, []
        flag = torch.tensor([1.0 if reasons else 0.0], device=self._device)
        self._manager.allreduce(flag, reduce_op=ReduceOp.MAX).wait()
        if flag.item() <= 0:
            return False
        local = "; ".join(reasons) if reasons else "raised by another replica"
        self._manager.report_error(CommitVetoed(f"step vetoed: {local}"))
        self.vetoed_steps += 1
        return True
