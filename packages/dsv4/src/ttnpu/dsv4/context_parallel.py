"""Context parallelism: the ranks of a CP group each hold one contiguous slice of every sequence.

What crosses a slice border, and how:

- the sliding window's keys: each rank sends the last ``window - 1`` rows of its (rotated) KV to
  the next rank (a point-to-point halo; its backward sends the gradient back);
- a compressed block that straddles a border: the rank that holds the block's last token computes
  its entry, from a halo of the tokens before its slice (and, for CSA, the previous block too);
- compressed entries and indexer keys: each rank computes the entries of the blocks that end in
  its slice, then all of them are all-gathered along the sequence (differentiably: the backward
  reduce-scatters their gradients to the ranks that computed them);
- sequence-level statistics (the balance loss's expert counts, the indexer loss's query count)
  are summed over the group.

Every CP rank of a group gets the whole sequence and computes its slice; its loss is its share:
the shares of a group sum to the loss of the whole sequence, so gradients summed over the group
are the whole sequence's. Slices follow ``torch.tensor_split`` (lengths differ by at most one), so
a sequence length need not be a multiple of the degree or of any block size.

Without a group (:meth:`SequenceShard.whole`) every operation is the single-rank one, with no
communication: one code path for CP = 1 and CP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

__all__ = ["ContextParallel", "SequenceShard", "check_halo", "compressor_halo", "split"]


def split(length: int, size: int) -> tuple[tuple[int, int], ...]:
    """Each of ``size`` ranks' slice ``(start, stop)`` of a sequence of ``length`` tokens
    (``torch.tensor_split``'s: the first ``length % size`` slices have one token more)."""
    if size < 1:
        raise ValueError(f"the context-parallel degree must be >= 1, got {size}")
    if length < size:
        raise ValueError(
            f"a sequence of {length} tokens cannot be split over {size} context-parallel ranks "
            f"(every rank needs at least one token)"
        )
    small, extra = divmod(length, size)
    starts = [r * small + min(r, extra) for r in range(size + 1)]
    return tuple(pairwise(starts))


def compressor_halo(start: int, ratio: int, overlap: bool) -> int:
    """How many tokens before a slice starting at ``start`` its compressed blocks read: the part
    of the block that straddles the border, and with ``overlap`` (CSA) the block before it."""
    return start - max(start // ratio - int(overlap), 0) * ratio


def check_halo(bounds: tuple[tuple[int, int], ...], rows: int, what: str) -> None:
    """Every slice but the last must hold the ``rows``-token halo it sends to the next rank."""
    for rank, (start, stop) in enumerate(bounds[:-1]):
        if stop - start < rows:
            raise ValueError(
                f"context-parallel rank {rank} holds {stop - start} tokens, fewer than the "
                f"{rows}-token halo of the {what} that the next rank needs: use a longer sequence "
                f"or a lower context_parallel_degree"
            )


@dataclass(frozen=True)
class ContextParallel:
    """A CP process group; :meth:`shard` gives this rank's slice of a sequence."""

    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def shard(self, length: int) -> SequenceShard:
        return SequenceShard(split(length, self.size), self.rank, self.group)


@dataclass(frozen=True)
class SequenceShard:
    """This rank's slice ``[start, stop)`` of a sequence of ``length`` tokens; ``bounds`` are every
    rank's slices, in rank order."""

    bounds: tuple[tuple[int, int], ...]
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @classmethod
    def whole(cls, length: int) -> SequenceShard:
        """The whole sequence on one rank (no context parallelism)."""
        return cls(((0, length),))

    @property
    def start(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def stop(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def length(self) -> int:
        return self.bounds[-1][1]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole-sequence tensor [B, S, ...]."""
        return x[:, self.start : self.stop]

    def halo(self, x: torch.Tensor, rows: int, what: str, sent: int | None = None) -> torch.Tensor:
        """The ``rows`` tokens before this slice, from the previous rank's local ``x`` [B, L, ...]
        (zeros before the sequence start). Every rank sends its last ``sent`` rows (default
        ``rows``; the same on every rank) and keeps the last ``rows`` of what it receives;
        ``what`` needs them (named in the error when a slice is too short)."""
        sent = rows if sent is None else sent
        if self.group is None or sent == 0:
            return x.new_zeros(x.shape[0], rows, *x.shape[2:])
        check_halo(self.bounds, sent, what)
        received = _FromPrevious.apply(x[:, -sent:], self)
        return received[:, sent - rows :]

    def gather_entries(self, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        """All compressed entries [B, length // ratio, ...] from each rank's own ones [B, n, ...]:
        those of the blocks that end in its slice."""
        if self.group is None:
            return entries
        counts = [b // ratio - a // ratio for a, b in self.bounds]
        width = max(counts)
        padded = F.pad(entries, (0, 0) * (entries.dim() - 2) + (0, width - entries.shape[1]))
        # Gathered along dim 0 (the one all_gather_single supports), entries first.
        gathered = funcol.all_gather_single_autograd(
            padded.transpose(0, 1).contiguous(), 0, self.group
        )
        keep = torch.cat(
            [torch.arange(count) + rank * width for rank, count in enumerate(counts)]
        ).to(entries.device)
        return funcol.wait_tensor(gathered).index_select(0, keep).transpose(0, 1)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the group, outside autograd (counts and other statistics)."""
        if self.group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group)
        return value


def _exchange(
    tensor: torch.Tensor, send_to: int | None, recv_from: int | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """Send ``tensor`` to group rank ``send_to`` and receive one of its shape from ``recv_from``
    (zeros when None)."""
    received = torch.zeros_like(tensor)
    ops = []
    if send_to is not None:
        peer = dist.get_global_rank(group, send_to)
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group))
    if recv_from is not None:
        peer = dist.get_global_rank(group, recv_from)
        ops.append(dist.P2POp(dist.irecv, received, peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


class _FromPrevious(torch.autograd.Function):
    """Each rank's ``tail`` goes to the next rank; the backward returns the gradient of what was
    received to the rank it came from."""

    @staticmethod
    def forward(ctx: Any, tail: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        assert shard.group is not None
        ctx.shard = shard
        last = len(shard.bounds) - 1
        send_to = shard.rank + 1 if shard.rank < last else None
        recv_from = shard.rank - 1 if shard.rank > 0 else None
        return _exchange(tail, send_to, recv_from, shard.group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shard: SequenceShard = ctx.shard
        assert shard.group is not None
        last = len(shard.bounds) - 1
        send_to = shard.rank - 1 if shard.rank > 0 else None
        recv_from = shard.rank + 1 if shard.rank < last else None
        return _exchange(grad, send_to, recv_from, shard.group), None
