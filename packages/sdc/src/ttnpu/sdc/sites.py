"""Where checksums attach: the covered aten ops, their operands, and how a result is reported.

Shared by the eager mode and the compiled pass so both check and report the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from .checksum import (
    SIGMAS,
    check_grouped_mm,
    check_matmul,
    grouped_mm_routed_dims,
    grouped_mm_screen,
    matmul_screen,
)
from .events import Reporter
from .fused import FusedPerSignature

__all__ = [
    "COVERED_OPS",
    "CheckStats",
    "Operands",
    "check_and_report",
    "compile_screens",
    "current_phase",
    "eager_screen",
    "operands",
    "report_suspect",
    "screen",
]

aten = torch.ops.aten
COVERED_OPS: dict[Any, str] = {
    aten.mm.default: "mm",
    aten.addmm.default: "addmm",
    aten.bmm.default: "bmm",
    aten._grouped_mm.default: "_grouped_mm",
    aten.mm.out: "mm",
    aten.addmm.out: "addmm",
    aten.bmm.out: "bmm",
}
"""aten overloads checked, with short names; ``matmul`` and ``linear`` decompose into these.
The ``out=`` overloads are what code compiled by Inductor calls for its products."""


@dataclass(frozen=True)
class Operands:
    a: Any
    b: Any
    bias: Any = None
    offs: Any = None
    alpha: float = 1.0
    beta: float = 1.0


def operands(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands:
    """The operands of a covered op from its call arguments (tensors or FX nodes)."""
    if op == "addmm":
        return Operands(
            args[1],
            args[2],
            bias=args[0],
            alpha=float(kwargs.get("alpha", 1.0)),
            beta=float(kwargs.get("beta", 1.0)),
        )
    if op == "_grouped_mm":
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        bias = args[3] if len(args) > 3 else kwargs.get("bias")
        return Operands(args[0], args[1], bias=bias, offs=offs)
    return Operands(args[0], args[1])


def current_phase() -> str:
    """ "backward" while the autograd engine runs a backward pass, else "forward"."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@dataclass
class CheckStats:
    """Counters of one checker: checks run, suspect checksums, false alarms, confirmed faults."""

    checked: int = 0
    suspects: int = 0
    false_alarms: int = 0
    faults: int = 0


def screen(
    op: str, ops: Operands, out: Tensor, sigmas: float = SIGMAS, fused: bool = False
) -> Tensor:
    """The covered op's checksum screen (0-d): the result passes where it is <= 1. The operands
    are those the op was called with, so they are not validated again here."""
    if op == "_grouped_mm":
        return grouped_mm_screen(ops.a, ops.b, out, ops.offs, ops.bias, sigmas, fused)
    return matmul_screen(ops.a, ops.b, out, ops.bias, ops.alpha, ops.beta, sigmas, fused)


SCREENS_COMPILE_AFTER = 20_000
"""Screens of one process run op by op until this many, then compiled
(:class:`~ttnpu.sdc.fused.FusedPerSignature`)."""
_screens_run = 0
# Eagerly a screen is ~10 small kernels, each reading its operand again (0.5 ms for a
# 512x256x768 bf16 product on a CPU, half of the GEMM); compiled, one pass over each operand
# (0.08 ms), once per signature of the product (shapes, strides: a training step repeats its
# few dozen every step; the rows routed to grouped products' experts, which follow the data
# under expert parallelism, are symbolic sizes, so those compile once) and called without
# Dynamo, whose per-call cost is as large as a small product's whole screen. Compiling costs 1-2 s a
# signature on a 2-core CPU with Inductor's cache cold: the screens compile after the process's
# first 20,000, so a process that checks a few steps (a test, a short run, sampled steps) runs
# them op by op and a long one compiles each signature once.
_WHAT = "eager matmul screens"
_SCREENS = {
    "matmul": FusedPerSignature(
        partial(matmul_screen, fused=True), _WHAT, eager=partial(matmul_screen, fused=False)
    ),
    "_grouped_mm": FusedPerSignature(
        partial(grouped_mm_screen, fused=True),
        _WHAT,
        eager=partial(grouped_mm_screen, fused=False),
        dynamic=grouped_mm_routed_dims,
    ),
}


def compile_screens() -> None:
    """Run the eager screens compiled from the next one on, without waiting for the process's
    first :data:`SCREENS_COMPILE_AFTER`: for a run that checks many steps from its start, or a
    benchmark that times the compiled screens (on a CPU without bf16 units, the bench's bf16
    model took over 15 minutes to reach them)."""
    global _screens_run
    _screens_run = max(_screens_run, SCREENS_COMPILE_AFTER)


@torch.no_grad()
def eager_screen(op: str, ops: Operands, out: Tensor, sigmas: float = SIGMAS) -> Tensor:
    """:func:`screen` of a product that has just run eagerly: compiled into one pass over each
    operand where :class:`~ttnpu.sdc.fused.FusedPerSignature` can, after the process's first
    :data:`SCREENS_COMPILE_AFTER` screens (operands detached: a check is not part of the
    autograd graph)."""
    global _screens_run
    _screens_run += 1
    fused = _SCREENS["_grouped_mm" if op == "_grouped_mm" else "matmul"]
    a, b, out = ops.a.detach(), ops.b.detach(), out.detach()
    bias = None if ops.bias is None else ops.bias.detach()
    args = (
        (a, b, out, ops.offs, bias)
        if op == "_grouped_mm"
        else (a, b, out, bias, ops.alpha, ops.beta)
    )
    if _screens_run > SCREENS_COMPILE_AFTER:
        return fused(*args, sigmas)
    with _disable_current_modes():  # a mode around the checked op sees none of the screen's ops
        return fused.eager(*args, sigmas)


def check_and_report(
    op: str,
    ops: Operands,
    out: Tensor,
    *,
    where: str,
    reporter: Reporter,
    stats: CheckStats,
    sigmas: float = SIGMAS,
    screened: Tensor | None = None,
) -> None:
    """Check one covered op's output; report a confirmed fault as a ``matmul`` event.

    ``screened`` is the op's :func:`screen` when it was computed already (in a compiled graph);
    only a result that does not pass it is judged in full and confirmed.
    """
    stats.checked += 1
    if screened is None:
        screened = eager_screen(op, ops, out, sigmas)
    if screened.item() <= 1.0:  # NaN is not
        return
    if op == "_grouped_mm":
        result = check_grouped_mm(ops.a, ops.b, out, offs=ops.offs, bias=ops.bias, sigmas=sigmas)
    else:
        result = check_matmul(
            ops.a, ops.b, out, bias=ops.bias, alpha=ops.alpha, beta=ops.beta, sigmas=sigmas
        )
    stats.suspects += result.suspect
    stats.false_alarms += result.verdict == "false_alarm"
    if not result.ok:
        stats.faults += 1
        reporter.report(
            "matmul",
            where,
            magnitude=result.magnitude,
            confirmed=result.verdict in ("transient", "persistent"),
            detail={
                "op": op,
                "verdict": result.verdict,
                "error": result.error,
                "bound": result.bound,
                "dtype": str(out.dtype),
                "shape": "x".join(map(str, out.shape)),
            },
        )


def report_suspect(
    reporter: Reporter,
    stats: CheckStats,
    where: str,
    magnitude: float,
    *,
    op: str,
    dtype: str,
    shape: str,
) -> None:
    """Report a product whose screen failed after its operands are gone: an unconfirmed
    ``matmul`` event (``verdict`` "suspect"), for a re-run under per-product verdicts to
    confirm."""
    stats.suspects += 1
    reporter.report(
        "matmul",
        where,
        magnitude=magnitude,
        confirmed=False,
        detail={"op": op, "verdict": "suspect", "dtype": dtype, "shape": shape},
    )
