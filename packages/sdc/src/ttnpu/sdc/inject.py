"""Bit-flip fault injection for tests and drills: matmul outputs (eager and compiled), any tensor.

``flip_bit`` corrupts one element of any tensor in place (a gradient, a collective buffer). A
:class:`FaultPlan` says which covered matmul call to corrupt; :class:`MatmulFaultMode` applies it in
eager code, :func:`arm_compiled_fault` inside graphs compiled with the checksum pass and
``fault_injection=True`` (a hook right after each matmul corrupts the product before anything
reads it: its checksum and its consumers see the corrupted value).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from .sites import COVERED_OPS, current_phase

__all__ = [
    "BitFlip",
    "FaultPlan",
    "MatmulFaultMode",
    "arm_compiled_fault",
    "disarm_compiled_fault",
    "flip_bit",
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: Tensor, index: int, bit: int) -> float:
    """Flip ``bit`` (0 = least significant) of flat element ``index`` in place; returns the change.

    The change is ``new - old`` as a Python float (inf or nan when the flip makes the element so).
    """
    width = tensor.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"flip_bit: bit must be in [0, {width}) for {tensor.dtype}, got {bit}")
    if not 0 <= index < tensor.numel():
        raise ValueError(f"flip_bit: index must be in [0, {tensor.numel()}), got {index}")
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tensor.shape))
    with torch.no_grad():
        old = float(tensor[pos])
        ints = tensor.view(_INT_OF_SIZE[tensor.element_size()])
        mask = 1 << bit
        if ints.dtype != torch.uint8 and mask >= 1 << (width - 1):
            mask -= 1 << width  # the sign bit of a signed integer view
        ints[pos] = ints[pos] ^ mask
        return float(tensor[pos]) - old


@dataclass(frozen=True)
class BitFlip:
    """Flip ``bit`` of the flat element ``index`` (taken modulo the tensor's size)."""

    index: int
    bit: int


@dataclass
class FaultPlan:
    """Corrupt the ``call``-th (0-based) matching matmul; with ``persistent``, every one after too.

    ``ops`` limits the sites to some covered ops ("mm", "addmm", "bmm", "_grouped_mm"); ``phase``
    to "forward" or "backward". ``fired`` counts the corruptions done, ``deltas`` their changes.
    """

    flips: Sequence[BitFlip]
    call: int = 0
    ops: frozenset[str] | None = None
    phase: str | None = None
    persistent: bool = False
    fired: int = 0
    deltas: list[float] = field(default_factory=list)
    _seen: int = field(default=0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def maybe_corrupt(self, op: str, phase: str, out: Tensor) -> bool:
        """Apply the plan to this call's output if it matches; True when it corrupted ``out``."""
        if (self.ops is not None and op not in self.ops) or (
            self.phase is not None and phase != self.phase
        ):
            return False
        with self._lock:
            n, self._seen = self._seen, self._seen + 1
        if n < self.call or (n > self.call and not self.persistent) or out.numel() == 0:
            return False
        for flip in self.flips:
            self.deltas.append(flip_bit(out, flip.index % out.numel(), flip.bit))
        self.fired += 1
        return True


class MatmulFaultMode(TorchDispatchMode):
    """Dispatch mode that applies a :class:`FaultPlan` to covered matmuls run inside it.

    To have :class:`~ttnpu.sdc.ChecksumMode` see the fault, enter this mode first (outside)::

        with MatmulFaultMode(plan), ChecksumMode(): ...
    """

    def __init__(self, plan: FaultPlan) -> None:
        super().__init__()
        self.plan = plan

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        op = COVERED_OPS.get(func)
        if op is not None and isinstance(out, Tensor):
            self.plan.maybe_corrupt(op, current_phase(), out)
        return out


_compiled_plan: FaultPlan | None = None


def arm_compiled_fault(plan: FaultPlan) -> None:
    """Have the fault hooks of graphs compiled with ``fault_injection=True`` apply ``plan`` (at
    run time, no recompilation)."""
    global _compiled_plan
    _compiled_plan = plan


def disarm_compiled_fault() -> None:
    global _compiled_plan
    _compiled_plan = None


def compiled_fault(op: str, phase: str, out: Tensor) -> None:
    """Called by the compiled fault hook right after the matmul that produced ``out``."""
    plan = _compiled_plan
    if plan is not None:
        plan.maybe_corrupt(op, phase, out)
