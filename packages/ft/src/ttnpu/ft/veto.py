"""A cross-replica commit veto, and an agreed stop.

torchft's ``should_commit`` is an AND over the ranks of *one* replica group: a replica that spots a
problem (an SDC event, a NaN loss) only drops its own update while the others commit a step that
already contains its gradient. The veto is a SUM of 0/1 flags over the replicas before
``should_commit``: if any replica raised a flag, every replica reports an error and skips the step,
so weights stay identical everywhere and nobody needs to heal.

The same sum carries a second value, "stop requested": a replica asked to stop (SIGTERM) must not
leave alone, or the others wait for it in their next quorum. When any replica requested it, every
replica learns so in the same vote and all stop after the same step.

A vote is a ballot (``ballot()``: the flags, then a payload the step sums anyway) summed by some
all-reduce, then counted (``count()``). :class:`~ttnpu.ft.Replica` casts its ballot in the
gradient flags' all-reduce at the end of the backward, which costs no round trip of its own, and
holds a second vote (``vote()``, one small all-reduce) only when something can raise a flag after
the gradients were exchanged or the output is to be averaged. A replica healing in the step sends
its flags but no payload.
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
    callback); every replica votes alike once per step (or twice, see the module), after its
    gradients are reduced and before ``should_commit``.
    """

    def __init__(self, collectives: ManagedAllreduce, device: torch.device | str = "cpu") -> None:
        self._collectives = collectives
        self._manager: Manager = collectives.manager
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._reasons: list[str] = []
        self._cast: list[str] = []  # the reasons the last ballot carried
        self._stop = False

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

    def ballot(self, payload: torch.Tensor | None = None) -> torch.Tensor:
        """This replica's ballot, ``[flag, stop, *payload]`` in float32 (the widest float HCCL
        reduces on Atlas A2/A3): the reasons raised so far are taken by it (the flag is 1 when
        there are any). Sum it over the replicas and hand the sum to :meth:`count`."""
        with self._lock:
            self._cast, self._reasons = self._reasons, []
        votes = torch.tensor(
            [float(bool(self._cast)), float(self._stop)], dtype=torch.float32, device=self._device
        )
        if payload is None:
            return votes
        return torch.cat((votes, payload.detach().reshape(-1).to(votes)))

    def count(self, sums: torch.Tensor) -> Vote:
        """The decision of the ballots summed in ``sums`` (this replica's own where the sum
        failed: the step does not commit then); on a veto, report ``CommitVetoed``.
        ``Vote.payload`` is what followed the two flags (None when nothing did)."""
        vetoed, stop = (bool(v > 0) for v in sums[:2].tolist())
        if vetoed:
            local = "; ".join(self._cast) if self._cast else "raised by another replica"
            if self._manager.errored() is None:  # a failed collective keeps its own report
                self._manager.report_error(CommitVetoed(f"step vetoed: {local}"))
        return Vote(vetoed=vetoed, stop=stop, payload=sums[2:] if sums.numel() > 2 else None)

    def vote(self, payload: torch.Tensor | None = None) -> Vote:
        """A vote of its own: the ballot (``payload``, any shape, comes back flattened and
        summed in ``Vote.payload``) all-reduced, then counted."""
        votes = self.ballot(payload)
        self._allreduce(votes)
        return self.count(votes)

    def discard(self) -> None:
        """Forget the reasons raised in a step that was discarded without a vote (a lost peer,
        a timed-out collective): they must not veto the step's re-run."""
        with self._lock:
            self._reasons = []

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
