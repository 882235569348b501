"""A cross-replica commit veto, and an agreed stop.

torchft's ``should_commit`` is an AND over the ranks of *one* replica group: a replica that spots a
problem (an SDC event, a NaN loss) only drops its own update while the others commit a step that
already contains its gradient. The veto is one all-reduce (a SUM of 0/1 flags) through the
Manager before ``should_commit``: if any replica raised a flag, every replica reports an error
and skips the step, so weights stay identical everywhere and nobody needs to heal.

The same all-reduce carries a second value, "stop requested": a replica asked to stop (SIGTERM)
must not leave alone, or the others wait for it in their next quorum. When any replica requested
it, every replica learns so in the same vote and all stop after the same step.

The vote may carry a payload that the step sums across replicas anyway (the loss to average, the
MoE token counters): one small all-reduce a step instead of three, each a round trip on the
critical path between the backward and the commit (:class:`~ttnpu.ft.managed.ManagedAllreduce`:
torchft's rules without the managed work's wrapping, which cost as much as the all-reduce
itself). A replica healing in the step sends its flags but no payload.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torchft import Manager

from ttnpu.ft.managed import ManagedAllreduce

__all__ = ["CommitVeto", "CommitVetoed", "Vote"]


class CommitVetoed(RuntimeError):
    """Reported to the Manager on every replica when any replica vetoed the step."""


@dataclass(frozen=True)
class Vote:
    """The cross-replica decision of one step: the same on every replica."""

    vetoed: bool  # some replica raised a flag: nobody commits the step
    stop: bool  # some replica requested a stop: everybody stops after the step
    payload: torch.Tensor | None = None  # the payload summed over the replicas (float32)


class CommitVeto:
    """Collects local veto reasons during a step and turns them into a cross-replica decision.

    ``raise_flag`` and ``request_stop`` may be called from any thread (a detector hook, a
    callback); ``vote`` must be called by every replica once per step, after the gradient
    all-reduce and before ``should_commit``.
    """

    def __init__(self, collectives: ManagedAllreduce, device: torch.device | str = "cpu") -> None:
        self._collectives = collectives
        self._manager: Manager = collectives.manager
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._reasons: list[str] = []
        self._stop = False
        self.vetoed_steps = 0

    def raise_flag(self, reason: str) -> None:
        """Ask every replica to skip the current step."""
        with self._lock:
            self._reasons.append(reason)

    def request_stop(self) -> None:
        """Ask every replica to stop after the step whose vote comes next. The request stays
        until the process ends: a step discarded before its vote carries it to the next one."""
        self._stop = True  # one store of a bool: no lock, so a signal handler may call it too

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return list(self._reasons)

    def vote(self, payload: torch.Tensor | None = None) -> Vote:
        """SUM all-reduce of [flag, stop, *payload] (flags are 0 or 1: a sum above 0 is "any");
        on a veto, report ``CommitVetoed``. ``payload`` (any shape) comes back flattened in
        ``Vote.payload``, summed in float32 (the widest float HCCL reduces on Atlas A2/A3)."""
        with self._lock:
            reasons, self._reasons = self._reasons, []
        votes = torch.tensor(
            [float(bool(reasons)), float(self._stop)], dtype=torch.float32, device=self._device
        )
        if payload is not None:
            votes = torch.cat((votes, payload.detach().reshape(-1).to(votes)))
        self._allreduce(votes)
        vetoed, stop = (bool(v > 0) for v in votes[:2].tolist())
        if vetoed:
            local = "; ".join(reasons) if reasons else "raised by another replica"
            if self._manager.errored() is None:  # a failed collective keeps its own report
                self._manager.report_error(CommitVetoed(f"step vetoed: {local}"))
            self.vetoed_steps += 1
        return Vote(vetoed=vetoed, stop=stop, payload=votes[2:] if payload is not None else None)

    def _allreduce(self, votes: torch.Tensor) -> None:
        """SUM over the replicas in place; a failure leaves this replica's own values."""
        if self._manager.errored() is not None:
            return  # a failed collective already discards the step (and may have torn the group)
        self._manager.wait_quorum()
        if self._collectives.pg.size() == 1:
            return
        local = votes.clone()
        # Healing, its output and counters are not the step's, its flags are.
        if not self._collectives.wait(self._collectives.start(votes, healing_keeps=2)):
            votes.copy_(local)  # not sent, or a peer died mid-vote: the step will not commit
