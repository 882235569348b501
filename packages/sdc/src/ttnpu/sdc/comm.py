"""Communication checks: collectives verified against independently reduced checksums of the inputs.

Each rank sums its input in chunks of ``L`` elements (plain sum and sum of magnitudes, in fp32).
These checksums travel through their own small collective, independently of the data, and the
result's chunk sums must match them within a worst-case rounding bound: an all-reduce of W ranks
rounds each element at most W-1 times, each time by at most u·Σ_r|x_r| (u the unit roundoff of the
data dtype), and our fp32 sums add at most L·u32 per side. Because the bound is worst-case, not
statistical, a mismatch proves corruption (of the data or of the checksums) and is reported as
confirmed. ``L`` is chosen from the dtype and W so that the whole bound stays below half of the
largest element magnitude (Σ_r|x_r|) of the chunk: every corruption at least that large is caught.
The same code runs over gloo, nccl and hccl groups; it only uses the collectives themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .checksum import unit_roundoff
from .events import Reporter, default_reporter
from .fused import Fused

__all__ = ["CollectiveChecker", "ReductionChecksums", "chunk_length"]

_U32 = unit_roundoff(torch.float32)
_MAX_CHUNK = 4096


def chunk_length(dtype: torch.dtype, world_size: int) -> int:
    """Largest L (<= 4096) with L·((W-1)(u+u32) + 2·L·u32) <= 1/2 for the data dtype's u."""
    per_rank = max(world_size - 1, 1) * (unit_roundoff(dtype) + _U32)
    # Solve 2·u32·L² + per_rank·L - 1/2 = 0 for its positive root.
    root = (-per_rank + math.sqrt(per_rank * per_rank + 4.0 * _U32)) / (4.0 * _U32)
    return max(1, min(_MAX_CHUNK, int(root)))


def _eager_chunk_sums(flat: Tensor, length: int, magnitudes: bool = True) -> Tensor:
    """Per-chunk sums of a 1-D tensor (the last chunk may be short), fp32: (2, chunks) with the
    sums of magnitudes as the second row, or (chunks,) without them (a result is judged by its
    sums alone). No padded copy; ``abs().sum()``, not ``vector_norm(1)``, which CPU kernels run
    several times slower: a gradient all-reduce checks tens of millions of elements every step."""
    converted = flat.dtype != torch.float32
    x = flat.to(torch.float32) if converted else flat
    full = x.numel() // length * length
    head, tail = x[:full].view(-1, length), x[full:]
    sums = torch.cat([head.sum(1), tail.sum().reshape(1)]) if full < x.numel() else head.sum(1)
    if not magnitudes:
        return sums
    # Magnitudes in place in our own fp32 copy: a fresh tensor of |x| is a second allocation of
    # the whole buffer, which costs more than the reduction on a CPU.
    x = x.abs_() if converted else x.abs()
    head, tail = x[:full].view(-1, length), x[full:]
    mags = torch.cat([head.sum(1), tail.sum().reshape(1)]) if full < x.numel() else head.sum(1)
    return torch.stack([sums, mags])


def _bad_chunks(got: Tensor, want: Tensor, magnitude: Tensor, coefficient: float) -> Tensor:
    """The chunks whose sums differ from the expected ones by more than the bound; a chunk whose
    expected sums are not finite is not judged, one whose result is NaN always fails."""
    bound = coefficient * magnitude
    judged = torch.isfinite(want) & torch.isfinite(magnitude)
    diff = torch.nan_to_num((got - want).abs(), nan=math.inf)
    return judged & (diff > bound)


def _eager_suspect(
    result: Tensor, want: Tensor, magnitude: Tensor, length: int, coefficient: float
) -> Tensor:
    """Whether any chunk of ``result`` fails (0-d bool): the check's whole clean path."""
    got = _eager_chunk_sums(result, length, magnitudes=False)
    return _bad_chunks(got, want, magnitude, coefficient).any()


# Compiled, each checksum is one pass over the data: the chunk sums (and magnitudes) read a bf16
# buffer once instead of converting it to fp32 and reading that copy two or three times (on a
# CPU: 0.45 instead of 1.6 ms for 3.9M elements; the result's check 0.3 instead of 1.3 ms).
_chunk_sums = Fused(_eager_chunk_sums, "collective checksums")
_suspect = Fused(_eager_suspect, "collective checksums")


def _verify_chunks(
    where: str,
    result: Tensor,
    expected: Tensor,
    length: int,
    world: int,
    reporter: Reporter,
    rank: int | None,
) -> bool:
    """Compare ``result``'s chunk sums with the reduced checksums ``expected`` (2, chunks); report
    a confirmed ``collective`` event naming the bad chunks when any is beyond the bound."""
    flat = result.reshape(-1)
    want, magnitude = expected[0], expected[1]
    u = unit_roundoff(result.dtype)
    coefficient = ((world - 1) * (u + _U32) + 2.0 * length * _U32) * 1.01
    if not bool(_suspect(flat, want, magnitude, length, coefficient)):
        return True
    got = _eager_chunk_sums(flat, length, magnitudes=False)
    bad = _bad_chunks(got, want, magnitude, coefficient)
    if not bool(bad.any()):  # compiled sums add in another order: a chunk right at the bound
        return True
    bound = coefficient * magnitude
    diff = torch.nan_to_num((got - want).abs(), nan=math.inf)
    ratio = torch.where(bound > 0, diff / bound, torch.full_like(diff, math.inf))[bad]
    chunks = bad.nonzero().flatten().tolist()
    reporter.report(
        "collective",
        where,
        magnitude=float(ratio.max()),
        confirmed=True,
        rank=rank,
        detail={
            "bad_chunks": len(chunks),
            "first_bad_element": chunks[0] * length,
            "chunk_length": length,
            "dtype": str(result.dtype),
            "numel": result.numel(),
            "world_size": world,
        },
    )
    return False


class ReductionChecksums:
    """Verify a reduction that someone else runs (torchft's Manager across replica groups).

    ``before(local)`` returns per-chunk checksums of the local buffer, which the caller reduces
    with the same reduction as the buffer but separately from it. ``after(result, checksums,
    world)`` checks the reduced buffer against the reduced checksums. SUM and AVG reductions
    both work: an average divides both sides alike, and its rounding is one more term of the
    bound (counted as one more rank). ``max_world`` fixes the chunk length, so the checksums
    can be computed before the reduction's size is known. A mismatch is reported as a confirmed
    ``collective`` event (``rank`` None: the reporter's); ``fault`` (drills, tests) corrupts the
    result before the check.
    """

    def __init__(
        self,
        max_world: int,
        *,
        reporter: Reporter | None = None,
        rank: int | None = None,
        fault: Callable[[str, Tensor], None] | None = None,
        name: str = "all_reduce",
    ) -> None:
        if max_world < 1:
            raise ValueError(f"ReductionChecksums: max_world must be >= 1, got {max_world}")
        self.max_world = max_world
        self.reporter = reporter
        self.rank = rank
        self.fault = fault
        self.name = name
        self.calls = 0
        self.failures = 0

    def _length(self, dtype: torch.dtype) -> int:
        return chunk_length(dtype, self.max_world + 1)

    def before(self, local: Tensor) -> Tensor:
        """The checksums of ``local`` (fp32, shape (2, chunks)), to reduce like ``local``."""
        self.calls += 1
        return _chunk_sums(local.reshape(-1), self._length(local.dtype))

    def after(self, result: Tensor, checksums: Tensor, world: int) -> bool:
        """Whether the reduced ``result`` matches the reduced ``checksums`` of ``world`` ranks."""
        if not 1 <= world <= self.max_world:
            raise ValueError(
                f"ReductionChecksums: world {world} must be in [1, max_world = {self.max_world}]"
            )
        if self.fault is not None:
            self.fault(self.name, result)
        ok = _verify_chunks(
            f"{self.name}#{self.calls}", result, checksums, self._length(result.dtype),
            world + 1, self.reporter or default_reporter(), self.rank,
        )  # fmt: skip
        self.failures += not ok
        return ok


class CollectiveChecker:
    """Run collectives on ``group`` and verify their results (SUM; AVG for the reduce-scatter;
    each returns True when clean).

    ``fault``, when set, is applied to the local result between the collective and its
    verification (drills and tests inject bit flips there). A failed verification is reported as
    a confirmed ``collective`` event naming the collective, its call number and the bad chunks.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        reporter: Reporter | None = None,
        fault: Callable[[str, Tensor], None] | None = None,
    ) -> None:
        self.group = group
        self.reporter = reporter
        self.fault = fault
        self.calls = 0
        self.failures = 0

    def _world(self) -> tuple[int, int]:
        if self.group is not None:
            return self.group.rank(), self.group.size()
        return dist.get_rank(), dist.get_world_size()

    def _verify(self, name: str, result: Tensor, expected: Tensor, length: int, world: int) -> bool:
        """Compare the result's chunk sums with the reduced checksums ``expected`` (2, chunks);
        ``world`` is the number of roundings the bound allows (the ranks, one more for AVG)."""
        ok = _verify_chunks(
            f"{name}#{self.calls}", result, expected, length, world,
            self.reporter or default_reporter(), self._world()[0],
        )  # fmt: skip
        self.failures += not ok
        return ok

    def _check_op(
        self, op: dist.ReduceOp | dist.ReduceOp.RedOpType, *ops: dist.ReduceOp.RedOpType
    ) -> None:
        allowed = (dist.ReduceOp.SUM, *ops)
        if op not in allowed:
            names = " and ".join(str(o).rsplit(".", 1)[-1] for o in allowed)
            raise ValueError(f"CollectiveChecker verifies {names} reductions here, got {op}")

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> bool:
        """In-place all-reduce of ``tensor``, verified."""
        self._check_op(op)
        self.calls += 1
        _, world = self._world()
        length = chunk_length(tensor.dtype, world)
        sums = _chunk_sums(tensor.reshape(-1), length)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(tensor, group=self.group)
        if self.fault is not None:
            self.fault("all_reduce", tensor)
        return self._verify("all_reduce", tensor, sums, length, world)

    def reduce_scatter_tensor(
        self,
        output: Tensor,
        input: Tensor,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> bool:
        """``output`` = this rank's segment of the sum (or average) of every rank's ``input``,
        verified. An average divides the summed checksums alike; its rounding is one more term of
        the bound."""
        self._check_op(op, dist.ReduceOp.AVG)
        self.calls += 1
        rank, world = self._world()
        if input.numel() != world * output.numel():
            raise ValueError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                f"world_size ({world}) x output ({output.numel()})"
            )
        roundings = world + (op == dist.ReduceOp.AVG)
        length = chunk_length(input.dtype, roundings)
        segments = input.reshape(world, -1)
        sums = torch.stack([_chunk_sums(s, length) for s in segments], 1).contiguous()
        dist.all_reduce(sums, group=self.group)
        dist.reduce_scatter_single(output, input, group=self.group, op=op)
        if self.fault is not None:
            self.fault("reduce_scatter_tensor", output)
        expected = sums[:, rank] if roundings == world else sums[:, rank] / world
        return self._verify("reduce_scatter_tensor", output, expected, length, roundings)

    def all_gather_into_tensor(self, output: Tensor, input: Tensor) -> bool:
        """``output`` = every rank's ``input`` concatenated, verified segment by segment."""
        self.calls += 1
        _, world = self._world()
        if output.numel() != world * input.numel():
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"world_size ({world}) x input ({input.numel()})"
            )
        length = chunk_length(input.dtype, world)
        local = _chunk_sums(input.reshape(-1), length)
        gathered = local.new_empty((world * local.shape[0], local.shape[1]))
        dist.all_gather_single(gathered, local, group=self.group)
        dist.all_gather_single(output, input, group=self.group)
        gathered = gathered.view(world, *local.shape)
        if self.fault is not None:
            self.fault("all_gather_into_tensor", output)
        # Copies are exact: verify each segment against its sender's sums with a one-rank bound.
        ok = True
        for r, segment in enumerate(output.reshape(world, -1)):
            ok &= self._verify(f"all_gather_into_tensor[{r}]", segment, gathered[r], length, 1)
        return ok
