"""Algorithm-based fault tolerance (ABFT) for matrix products: row checksums judged by rounding.

For C = alpha·A·B + beta·bias the row sums satisfy C·1 = alpha·A·(B·1) + beta·bias·1 exactly, so
an element of C that was corrupted after (or while) it was computed shows up as a row whose sum
disagrees with the sum predicted from A and B. What makes the check usable is the bound: a row is
only suspect when its disagreement exceeds what rounding can explain. The bound is built from the
unit roundoff of the output dtype (C is rounded once per element), of the accumulation (fp32 for
half-precision inputs, as on tensor cores, Ascend cube units and oneDNN), of reduced-precision fp32
inputs (``torch.get_float32_matmul_precision``) and of our own fp32 checksum arithmetic, with the
shapes (K products per element, N elements per row). Rounding errors are treated as independent,
zero-mean and bounded (round-to-nearest), so their sum has a standard deviation we can bound; a row
is suspect beyond ``sigmas`` of those deviations.

A suspect result is confirmed before it is reported: the product is recomputed on the same device
(a transient fault does not come back), and if the recomputation is suspect too, both are compared
element by element with an fp64 reference computed on the host (a persistent fault of the device
does not survive a different unit). Only then is ``ok`` False.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["SIGMAS", "CheckResult", "Verdict", "check_grouped_mm", "check_matmul", "unit_roundoff"]

SIGMAS = 6.0
"""Standard deviations of the rounding noise a checksum may deviate before it is suspect."""

Verdict = Literal["clean", "transient", "persistent", "false_alarm", "unconfirmed"]
_SEVERITY: dict[Verdict, int] = {
    "clean": 0,
    "false_alarm": 1,
    "unconfirmed": 2,
    "transient": 3,
    "persistent": 4,
}
_SQRT3 = math.sqrt(3.0)


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one checksum: ``ok`` is False only for a fault confirmed by recomputation.

    ``error`` and ``bound`` are those of the worst row (largest error/bound); ``suspect`` says the
    checksum exceeded the bound somewhere; ``verdict`` tells a transient fault (recomputation
    disagrees with the result), a persistent one (recomputation repeats it, an fp64 host reference
    does not) and a false alarm of the checksum apart.
    """

    ok: bool
    error: float
    bound: float
    suspect: bool
    verdict: Verdict

    @property
    def magnitude(self) -> float:
        """error / bound (inf for a nonzero error against a zero bound)."""
        if self.bound > 0:
            return self.error / self.bound
        return math.inf if self.error > 0 else 0.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """2^-p for a floating dtype with p significand bits: the relative error of one rounding."""
    return torch.finfo(dtype).eps / 2.0


def _subnormal_roundoff(dtype: torch.dtype) -> float:
    """Absolute rounding error of a result in the subnormal range (half its spacing there)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2.0


def _input_roundoff(dtype: torch.dtype) -> float:
    """Rounding of fp32 inputs when matmuls run in TF32 or bf16 (float32 matmul precision)."""
    if dtype != torch.float32:
        return 0.0
    return {"highest": 0.0, "high": 2.0**-11, "medium": 2.0**-8}.get(
        torch.get_float32_matmul_precision(), 0.0
    )


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_check(
    a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None, alpha: float, beta: float, sigmas: float
) -> tuple[Tensor, Tensor]:
    """Per-row |checksum error| and its rounding bound (flattened over batch and rows).

    Two passes over each of A, B and C (after one fp32 conversion of each half-precision
    operand). The magnitude Σ_k |a_ik|·Σ_j|b_kj| is bounded by ‖a_i‖₂·√N·‖B‖_F (Cauchy-Schwarz
    twice) and Σ_j|c_ij| by √N·‖c_i‖₂: both only scale fp32 roundoff terms, and 2-norms are
    the fast reductions.
    """
    work = _work_dtype(out.dtype)
    k, n = a.shape[-1], b.shape[-1]
    a_ = a.to(work)
    b_ = b.to(work)  # one conversion each: reductions with dtype= convert on every call
    expected = (a_ @ b_.sum(-1, keepdim=True)).squeeze(-1) * alpha
    b_fro = torch.linalg.vector_norm(b_, dim=(-2, -1))
    mag = torch.linalg.vector_norm(a_, dim=-1) * (b_fro * math.sqrt(n) * abs(alpha)).unsqueeze(-1)
    if bias is not None:
        if bias.dim() == 1:  # one bias per column: its sums are scalars
            bias_sum, bias_abs = bias.sum(dtype=work), bias.abs().sum(dtype=work)
            if bias.shape[0] == 1:
                bias_sum, bias_abs = bias_sum * n, bias_abs * n
        else:
            bias_ = torch.broadcast_to(bias.to(work), out.shape)
            bias_sum, bias_abs = bias_.sum(-1), bias_.abs().sum(-1)
        expected = expected + beta * bias_sum
        mag = mag + abs(beta) * bias_abs
    c_ = out.to(work)
    c_sum = c_.sum(-1)
    c_norm = torch.linalg.vector_norm(c_, dim=-1)
    u_out, u_work, u_in = unit_roundoff(out.dtype), unit_roundoff(work), _input_roundoff(a.dtype)
    sigma = (
        (u_out / _SQRT3 + u_work * n) * c_norm
        + (u_work * (math.sqrt(k) * (1 + 1 / _SQRT3) + math.sqrt(n)) + 2.0 * u_in / _SQRT3) * mag
        + _subnormal_roundoff(out.dtype) * math.sqrt(n) / _SQRT3
    )
    bound = torch.broadcast_to(sigmas * sigma, out.shape[:-1])
    err = torch.broadcast_to((c_sum - expected).abs(), out.shape[:-1])
    if not bool(torch.isfinite(err.sum() + bound.sum())):
        err, bound = _nonfinite_rows(out, expected, mag, c_sum, err, bound)
    return err.reshape(-1), bound.reshape(-1)


def _nonfinite_rows(
    out: Tensor, expected: Tensor, mag: Tensor, c_sum: Tensor, err: Tensor, bound: Tensor
) -> tuple[Tensor, Tensor]:
    """Rows with NaN/Inf: wrong if the inputs are finite and cannot overflow, else unjudged."""
    work = err.dtype
    c_norm = torch.linalg.vector_norm(out, dim=-1, dtype=work)
    if not bool(torch.isfinite(c_norm).all()):  # squares overflowed: scale by the row maximum
        c_ = out.to(work)
        scale = c_.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(work).tiny)
        c_norm = torch.linalg.vector_norm(c_ / scale, dim=-1) * scale.squeeze(-1)
    expected, mag = torch.broadcast_to(expected, err.shape), torch.broadcast_to(mag, err.shape)
    out_bad = ~(torch.isfinite(c_sum) & torch.isfinite(c_norm))
    may_overflow = mag >= torch.finfo(out.dtype).max / 2
    judged = torch.isfinite(expected) & torch.isfinite(mag) & ~(out_bad & may_overflow)
    err = torch.where(out_bad, math.inf, err)
    err = torch.where(judged, err, torch.zeros_like(err))
    bound = torch.where(out_bad | ~torch.isfinite(bound), torch.zeros_like(bound), bound)
    bound = torch.where(judged, bound, torch.full_like(bound, math.inf))
    return err, bound


def _worst(err: Tensor, bound: Tensor) -> tuple[float, float, bool]:
    """Error and bound of the row with the largest error/bound, and whether it exceeds 1."""
    if err.numel() == 0:
        return 0.0, 0.0, False
    ratio = err / bound.clamp_min(torch.finfo(bound.dtype).tiny)
    i = ratio.argmax()
    e, bd, r = torch.stack([err[i], bound[i], ratio[i]]).tolist()
    return e, bd, r > 1.0


def _host_reference_disagrees(
    a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None, alpha: float, beta: float, sigmas: float
) -> bool:
    """Element-wise comparison with an fp64 product computed on the host, outside every mode."""
    with _disable_current_modes(), torch.no_grad():
        a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
        ref = alpha * (a64 @ b64)
        absprod = abs(alpha) * (a64.abs() @ b64.abs())
        if bias is not None:
            bias64 = bias.detach().cpu().double()
            ref, absprod = ref + beta * bias64, absprod + abs(beta) * bias64.abs()
        k = a.shape[-1]
        u_acc = unit_roundoff(_work_dtype(out.dtype))
        tol = (
            unit_roundoff(out.dtype) * ref.abs()
            + _subnormal_roundoff(out.dtype)
            + sigmas * (u_acc * math.sqrt(k) + 2.0 * _input_roundoff(a.dtype)) * absprod
        )
        diff = (out.detach().cpu().double() - ref).abs()
        return bool((torch.nan_to_num(diff, nan=math.inf) > tol).any())


def _validate(a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None) -> None:
    for name, t in (("a", a), ("b", b), ("out", out)):
        if not t.is_floating_point():
            raise TypeError(f"check_matmul: {name} must be a floating tensor, got {t.dtype}")
        if t.dim() < 1 + (name != "out"):
            raise ValueError(f"check_matmul: {name} must be at least 2-D, got {tuple(t.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"check_matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}: "
            "the last dim of a must equal the second-to-last dim of b"
        )
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    expected = (*batch, a.shape[-2], b.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(
            f"check_matmul: out is {tuple(out.shape)}, expected {expected} for a "
            f"{tuple(a.shape)} times b {tuple(b.shape)}"
        )
    if bias is not None:
        try:
            torch.broadcast_shapes(bias.shape, out.shape)
        except RuntimeError as e:
            raise ValueError(
                f"check_matmul: bias {tuple(bias.shape)} does not broadcast to out {expected}"
            ) from e


def check_matmul(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    *,
    bias: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    sigmas: float = SIGMAS,
    confirm: bool = True,
    recompute: Callable[[], Tensor] | None = None,
) -> CheckResult:
    """Check ``out == alpha * a @ b + beta * bias`` (2-D or broadcast-batched) by row checksums.

    Pure: nothing is modified. ``recompute`` replaces the default recomputation (``torch.matmul``,
    or ``torch.addmm`` for 2-D with a bias) used to confirm a suspect result; ``confirm=False``
    reports a suspect result as ``unconfirmed`` (and not ok) without recomputing.
    """
    _validate(a, b, out, bias)
    with torch.no_grad():
        err, bound = _row_check(a, b, out, bias, alpha, beta, sigmas)
        error, worst_bound, suspect = _worst(err, bound)
        if not suspect:
            return CheckResult(True, error, worst_bound, False, "clean")
        if not confirm:
            return CheckResult(False, error, worst_bound, True, "unconfirmed")
        redo = (recompute or (lambda: _recompute(a, b, bias, alpha, beta)))()
        redo_err, redo_bound = _row_check(a, b, redo, bias, alpha, beta, sigmas)
        if not _worst(redo_err, redo_bound)[2]:
            return CheckResult(False, error, worst_bound, True, "transient")
        if _host_reference_disagrees(a, b, out, bias, alpha, beta, sigmas):
            return CheckResult(False, error, worst_bound, True, "persistent")
        return CheckResult(True, error, worst_bound, True, "false_alarm")


def _recompute(a: Tensor, b: Tensor, bias: Tensor | None, alpha: float, beta: float) -> Tensor:
    """The same aten op again (mm, addmm, bmm), so a fault of that kernel can repeat."""
    plain = a.dim() == b.dim() == 2
    if bias is not None and plain:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    if plain:
        out = torch.mm(a, b)
    elif a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0]:
        out = torch.bmm(a, b)
    else:
        out = torch.matmul(a, b)
    if alpha != 1.0:
        out = out * alpha
    return out if bias is None else out + beta * bias


GroupTriple = tuple[Tensor, Tensor, Tensor, Tensor | None]


def grouped_mm_groups(
    a: Tensor, b: Tensor, out: Tensor, offs: Tensor | None, bias: Tensor | None
) -> list[GroupTriple]:
    """Split a ``torch._grouped_mm`` into per-group (a, b, out, bias) views of plain products."""
    if offs is None:
        if a.dim() != 3 or b.dim() != 3:
            raise ValueError(
                f"check_grouped_mm: without offs a and b must be 3-D, got {tuple(a.shape)} "
                f"and {tuple(b.shape)}"
            )
        return [(a, b, out, None if bias is None else bias.unsqueeze(-2))]
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    groups: list[GroupTriple] = []
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        bias_g = None if bias is None else bias[g]
        if a.dim() == 2 and b.dim() == 3:  # groups of rows: MoE expert forward
            groups.append((a[s:e], b[g], out[s:e], bias_g))
        elif a.dim() == 2 and b.dim() == 2:  # groups along K: expert weight gradient
            groups.append((a[:, s:e], b[s:e], out[g], bias_g))
        elif a.dim() == 3 and b.dim() == 2:  # groups of columns
            groups.append((a[g], b[:, s:e], out[:, s:e], None if bias_g is None else bias_g[s:e]))
        else:
            raise ValueError(
                f"check_grouped_mm: unsupported shapes {tuple(a.shape)} x {tuple(b.shape)} "
                "with offs"
            )
    return groups


def check_grouped_mm(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    *,
    offs: Tensor | None = None,
    bias: Tensor | None = None,
    sigmas: float = SIGMAS,
    confirm: bool = True,
) -> CheckResult:
    """Check ``out == torch._grouped_mm(a, b, offs=offs, bias=bias)`` group by group.

    The result is that of the worst group (highest verdict severity, then largest error/bound).
    """
    worst = CheckResult(True, 0.0, 0.0, False, "clean")
    for a_g, b_g, out_g, bias_g in grouped_mm_groups(a, b, out, offs, bias):
        r = check_matmul(a_g, b_g, out_g, bias=bias_g, sigmas=sigmas, confirm=confirm)
        if (_SEVERITY[r.verdict], r.magnitude) > (_SEVERITY[worst.verdict], worst.magnitude):
            worst = r
    return worst
