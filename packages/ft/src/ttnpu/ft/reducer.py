"""Cross-replica gradient averaging in buckets that start while the backward is still running.

A gradient-ready hook (``register_post_accumulate_grad_hook``) marks each parameter; when every
parameter of a bucket is ready, the bucket's all-reduce starts under the rules of torchft's Manager
(:class:`~ttnpu.ft.managed.ManagedAllreduce`), so a peer's death still fails the step there.
Buckets start strictly in their fixed order (every replica issues the same collectives in the same
order, whichever parameters it used), and the backward ends by waiting for all of them (an
autograd-engine callback, as DDP's reducer does), so code after ``backward()`` sees averaged
gradients. A gradient at least ``cap_bytes`` large is a bucket of its own and travels in place;
smaller ones are copied once into a bucket buffer whose views then become their ``.grad`` (a
gradient that already is that view is not copied again). A replica world of one member launches
nothing and copies nothing.

The buckets are summed, then divided by the replicas that contributed. One more all-reduce
sums flags: a caller's ballot first (the replica's veto vote, see :mod:`ttnpu.ft.veto`, which so
costs no round trip of its own), a 1 per contributing replica (torchft zeroes the tensors of a
replica that trained on stale weights, one healing under an asynchronous quorum, yet its own
average counts it) and, per parameter, whether it had a gradient: a parameter no replica produced
a gradient for gets ``grad = None`` back, so the optimizer leaves it alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributed import Work
from torch.distributed.tensor import DTensor

from ttnpu.ft.managed import ManagedAllreduce

__all__ = ["GradientReducer", "ReductionCheck"]


class ReductionCheck(Protocol):
    """Verifies the cross-replica gradient all-reduce, one bucket at a time (ttnpu-sdc's
    ``ReductionChecksums`` is one): ``before`` turns the local bucket into checksums, which are
    all-reduced on their own; ``after`` judges the reduced bucket against them. A failed check
    vetoes the step; an all-reduce torchft reported as failed is never judged."""

    def before(self, local: torch.Tensor) -> torch.Tensor: ...

    def after(self, result: torch.Tensor, checksums: torch.Tensor, world: int) -> bool: ...


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@dataclass(eq=False)
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    ready: int = 0
    tensor: torch.Tensor | None = None  # what is being reduced this step
    checksums: torch.Tensor | None = None
    works: list[Work | None] = field(default_factory=list)

    def view(self, i: int) -> torch.Tensor:
        assert self.buffer is not None
        p = self.params[i]
        local = _local(p)
        return self.buffer[self.offsets[i] : self.offsets[i] + local.numel()].view_as(local)


def _plan(params: list[torch.nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Buckets in the order gradients usually become ready (reverse registration order)."""
    buckets: list[_Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
    for p in reversed(params):
        local = _local(p)
        key = (p.dtype, local.device)
        if local.numel() * local.element_size() >= cap_bytes:
            buckets.append(_Bucket([p], [0], local.numel(), p.dtype, local.device))
            continue
        bucket = open_.get(key)
        if bucket is None or (bucket.numel + local.numel()) * local.element_size() > cap_bytes:
            bucket = open_[key] = _Bucket([], [], 0, p.dtype, local.device)
            buckets.append(bucket)
        bucket.params.append(p)
        bucket.offsets.append(bucket.numel)
        bucket.numel += local.numel()
    return buckets


class GradientReducer:
    """Averages the gradients of ``params`` across the replicas (see the module).

    ``begin_step()`` before the step's first backward; ``finish()`` after its last (a no-op when
    the backward's own callback already finished); backwards under ``no_sync()`` only accumulate.
    ``wait_quorum`` runs once a step before the first collective (the Manager's by default; a
    replica's also checks the quorum there, which may still be computing while the forward runs);
    ``wait_guard`` wraps the waits for the collectives (the replica's collective watchdog; the
    check's arithmetic is not a collective and runs outside it); ``on_corrupt`` is told when
    ``check`` rejects a bucket. ``ballot`` is cast once a step, when the backward ends: a float32
    tensor summed ahead of the flags, of which a healing replica still sends the first
    ``ballot_keeps`` elements; its sum is ``ballot_sums`` after ``finish()`` (the ballot itself
    when nothing was sent: alone, or the all-reduce failed).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        collectives: ManagedAllreduce,
        replica_world: Callable[[], int],
        *,
        cap_bytes: int,
        check: ReductionCheck | None = None,
        on_corrupt: Callable[[str], None] = lambda reason: None,
        wait_guard: Callable[[Callable[[], None]], None] = lambda fn: fn(),
        wait_quorum: Callable[[], None] | None = None,
        ballot: Callable[[], torch.Tensor] | None = None,
        ballot_keeps: int = 0,
    ) -> None:
        if cap_bytes < 1:
            raise ValueError(f"GradientReducer: cap_bytes must be >= 1, got {cap_bytes}")
        self.collectives = collectives
        self.manager = collectives.manager
        self.replica_world = replica_world
        self.check = check
        self.on_corrupt = on_corrupt
        self.wait_guard = wait_guard
        self.wait_quorum = wait_quorum or self.manager.wait_quorum
        self.ballot, self.ballot_keeps = ballot, ballot_keeps
        self.ballot_sums: torch.Tensor | None = None  # the last step's ballot, summed
        self.params = params
        self.buckets = _plan(params, cap_bytes)
        self._index = {id(p): n for n, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in params]
        self._syncing = True
        self._active = False
        self.contributors = 1  # replicas whose gradients the last step averaged
        self.finish_s = 0.0  # the waits left after the backward in the last step
        self.end_step()

    # -- the step --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start reducing: the step's gradients start from none (``zero_grad`` ran)."""
        self.end_step()
        self._active = True
        self.finish_s = 0.0
        self.contributors = 1
        self.ballot_sums = None

    def end_step(self) -> None:
        """Stop reducing and forget the step (its gradients were consumed or cleaned); a
        backward outside a step reduces nothing."""
        self._active = False
        self._had_grad: set[int] = set()
        self._world: int | None = None
        self._launched = 0  # buckets [0, launched) have started this step
        self._callback_queued = False
        self._finished = False
        for b in self.buckets:
            b.ready, b.tensor, b.checksums, b.works = 0, None, None, []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate gradients (all but the last micro-batch of a step)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _solo(self) -> bool:
        if self._world is None:
            self.wait_quorum()
            self._world = 0 if self.manager.errored() else self.replica_world()
        return self._world == 1

    def _on_ready(self, param: torch.Tensor) -> None:
        if not self._active:
            return
        self._had_grad.add(id(param))
        if not self._syncing:
            return
        index = self._index[id(param)]
        if self._finished or index < self._launched:
            raise RuntimeError(
                "GradientReducer: a second backward reached gradients already reduced this "
                "step; run all but the last backward of a step under replica.no_sync()"
            )
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        if self._solo():
            return
        self.buckets[index].ready += 1
        while self._launched < len(self.buckets) and (
            self.buckets[self._launched].ready == len(self.buckets[self._launched].params)
        ):
            self._launch(self.buckets[self._launched])

    def _launch(self, bucket: _Bucket) -> None:
        self._launched += 1
        with torch.no_grad():
            tensor = self._gather(bucket)
            if self.check is not None:
                bucket.checksums = self.check.before(tensor)
                bucket.works.append(self.collectives.start(bucket.checksums))
            bucket.works.append(self.collectives.start(tensor))
        bucket.tensor = tensor

    def _gather(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's gradients as one tensor: in place, or copied once into the buffer."""
        for p in bucket.params:  # FSDP2 assigns sharded gradients without the hook
            if p.grad is not None:
                self._had_grad.add(id(p))
        first = bucket.params[0]
        if len(bucket.params) == 1 and first.grad is not None:
            local = _local(first.grad)
            if local.is_contiguous():
                return local
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        for i, p in enumerate(bucket.params):
            view = bucket.view(i)
            if p.grad is None:
                view.zero_()
                p.grad = view if not isinstance(p, DTensor) else torch.zeros_like(p)
            elif isinstance(p.grad, DTensor):
                view.copy_(_local(p.grad))
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        return bucket.buffer

    def finish(self) -> None:
        """Launch what the hooks did not, cast the ballot, wait, check, copy DTensor shards
        back, drop the gradients no replica produced."""
        if self._finished:
            return
        self._finished = True
        t0 = time.perf_counter()
        ballot = self.ballot() if self.ballot is not None else None
        self.ballot_sums = ballot
        if not self._solo():  # alone, every gradient already is the average
            for bucket in self.buckets[self._launched :]:
                self._launch(bucket)
            flags = self._flags(ballot)
            works = [w for bucket in self.buckets for w in bucket.works]
            works.append(self.collectives.start(flags, healing_keeps=self.ballot_keeps))
            self.wait_guard(lambda: self._wait(works))
            if self.manager.errored() is None:  # a failed all-reduce is discarded, not judged
                cast = 0 if ballot is None else ballot.numel()
                self.ballot_sums = flags[:cast] if ballot is not None else None
                self.contributors = max(1, int(flags[cast]))
                self._judge()
                self._drop_unproduced(flags[cast + 1 :])
        self.finish_s = time.perf_counter() - t0

    def _wait(self, works: list[Work | None]) -> None:
        for work in works:
            self.collectives.wait(work)

    def _flags(self, ballot: torch.Tensor | None) -> torch.Tensor:
        had = [1.0] + [float(id(p) in self._had_grad) for p in self.params]
        device = self.buckets[0].device if self.buckets else None
        flags = torch.tensor(had, device=device)
        if ballot is None:
            return flags
        # the ballot stays the caller's own: summed in this copy, which a failure may tear
        return torch.cat((ballot.to(flags), flags))

    def _judge(self) -> None:
        """Check every bucket's sum, then turn it into the contributors' average."""
        world = self.replica_world()
        for n, bucket in enumerate(self.buckets):
            assert bucket.tensor is not None
            if self.check is not None:
                assert bucket.checksums is not None
                if not self.check.after(bucket.tensor, bucket.checksums, world):
                    self.on_corrupt(f"the gradient all-reduce of bucket {n} arrived corrupted")
            if self.contributors > 1:
                bucket.tensor.div_(self.contributors)
            if bucket.tensor is bucket.buffer:
                for i, p in enumerate(bucket.params):
                    if isinstance(p.grad, DTensor):
                        _local(p.grad).copy_(bucket.view(i))

    def _drop_unproduced(self, flags: torch.Tensor) -> None:
        for p, anyone in zip(self.params, flags.tolist(), strict=True):
            if anyone == 0:
                p.grad = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
