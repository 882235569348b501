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
is suspect beyond ``sigmas`` of those deviations plus the bias that the output's rounding keeps
along a row of same-signed values (:data:`OUTER_BIAS`, :data:`SUM_BIAS`).

A suspect result is confirmed before it is reported: the product is recomputed on the same device
(a transient fault does not come back), and if the recomputation is suspect too, both are compared
element by element with an fp64 reference computed on the host (a persistent fault of the device
does not survive a different unit). Only then is ``ok`` False.

The judgement of a clean product is :func:`screen_matmul` / :func:`screen_grouped_mm`: the worst
row's error over its bound as a 0-d tensor, with no host synchronisation and no branch on data, so
that the compiled pass can put it into the graph, where the compiler fuses its reductions with the
product's other readers. Only a product whose screen is not <= 1 goes through the full check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "OUTER_BIAS",
    "SIGMAS",
    "SUM_BIAS",
    "CheckResult",
    "Verdict",
    "check_grouped_mm",
    "check_matmul",
    "screen_grouped_mm",
    "screen_matmul",
    "unit_roundoff",
]

SIGMAS = 6.0
"""Standard deviations of the rounding noise a checksum may deviate before it is suspect."""

OUTER_BIAS = 0.5
"""Bound on a row's mean output rounding error, in units of u·|Σ_j c_ij|, when K = 1.

An outer product's element c_ij = a_i·b_j is exact before its one rounding, and its relative
rounding error depends only on the significands of a_i and b_j: along a row it is a fixed
function of b_j's significand, not zero-mean noise. Measured exhaustively over bf16 significand
pairs the mean reaches 0.38 u, so a wide row of same-signed values drifts far beyond √N rounding
noise. (A row whose b_j all share one significand rounds every element alike, up to u: see
:data:`SUM_BIAS`.)"""

SUM_BIAS = 0.05
"""The same bound for K >= 2: sums of products rounded once keep a small bias on same-signed data
(0.02 u·|Σ_j c_ij| measured for K = 2..16 on uniform [0, 1) bf16 operands). Columns of B that
repeat exactly make every element of a row round alike (up to u): such products are suspect and
cost a recomputation, which confirms nothing."""

Verdict = Literal["clean", "transient", "persistent", "false_alarm", "unconfirmed"]
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


@dataclass(frozen=True)
class _RowSums:
    """What the bound of one checked row needs, per row (or per row and group for grouped mm).

    ``expected`` and ``c_sum`` are the predicted and actual row sums, ``mag`` bounds
    Σ_k |a_ik|·Σ_j|b_kj| (+ the bias's Σ|·|), ``c_norm`` is ‖c_i‖₂; ``k`` and ``n`` are the
    products per element and the elements per row (scalars, or tensors broadcasting to the rows).
    """

    expected: Tensor
    mag: Tensor
    c_sum: Tensor
    c_norm: Tensor
    k: float | Tensor
    n: float | Tensor


def _rounding_bias(k: float | Tensor) -> float | Tensor:
    """Mean output rounding error of a row, in units of u·|Σ_j c_ij| (see :data:`OUTER_BIAS`)."""
    if isinstance(k, Tensor):
        return torch.where(k <= 1, OUTER_BIAS, SUM_BIAS)
    return OUTER_BIAS if k <= 1 else SUM_BIAS


def _bound(s: _RowSums, out_dtype: torch.dtype, in_dtype: torch.dtype, sigmas: float) -> Tensor:
    """``sigmas`` standard deviations of the rounding noise of a row's checksum, plus its bias."""
    work = s.c_sum.dtype
    u_out, u_work, u_in = unit_roundoff(out_dtype), unit_roundoff(work), _input_roundoff(in_dtype)
    sigma = (
        (u_out / _SQRT3 + u_work * s.n) * s.c_norm
        + (u_work * (s.k**0.5 * (1 + 1 / _SQRT3) + s.n**0.5) + 2.0 * u_in / _SQRT3) * s.mag
        + _subnormal_roundoff(out_dtype) * s.n**0.5 / _SQRT3
    )
    return sigmas * sigma + _rounding_bias(s.k) * u_out * s.c_sum.abs()


def _judge(
    s: _RowSums, out: Tensor, in_dtype: torch.dtype, sigmas: float, rows: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """Per-row |checksum error| and its bound, flattened (non-finite rows judged apart)."""
    bound = torch.broadcast_to(_bound(s, out.dtype, in_dtype, sigmas), rows)
    err = torch.broadcast_to((s.c_sum - s.expected).abs(), rows)
    if not bool(torch.isfinite(err.sum() + bound.sum())):
        err, bound = _nonfinite_rows(out, s, err, bound, in_dtype, sigmas)
    return err.reshape(-1), bound.reshape(-1)


def _sum_and_norm(x: Tensor, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """Row sums and 2-norms of ``x`` in ``work`` precision, after one conversion (a reduction
    with ``dtype=`` converts its whole input on every call)."""
    x_ = x.to(work)
    return x_.sum(-1), _row_norm(x_)


def _row_norm(x: Tensor, fused: bool = False) -> Tensor:
    """2-norms of the rows of ``x``: ``linalg.vector_norm`` where they are contiguous (the usual
    layout of a product and of a forward operand), 2-4x faster on CPU than a square and a sum,
    which writes the squares; a square and a sum over strided rows (transposed operands), where
    ``linalg.vector_norm`` is 5-30x slower. ``fused``: a square and a sum, which a compiler fuses
    into its pass whatever the layout (an operand's strides may be symbolic there)."""
    if fused or x.stride(-1) != 1:
        return _norm(x, -1)
    return torch.linalg.vector_norm(x, dim=-1)


def _norm(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """2-norm over ``dim`` as a square and a sum: fast over strided dims, and what a compiler
    fuses into its pass whatever the layout."""
    return x.square().sum(dim).sqrt()


def _sums_along_rows(b: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
    """Row sums of ``b`` (..., K) and its Frobenius norm over the last two dims (...,). ``fused``
    takes the norm from the rows' sums of squares, a reduction along the same dim that a compiler
    fuses with the sums (one pass over B instead of two); eagerly ``linalg.vector_norm`` of the
    whole matrix is faster (it reads B in memory order, whatever its layout, and writes no
    squares)."""
    if fused:
        return b.sum(-1), b.square().sum(-1).sum(-1).sqrt()
    return b.sum(-1), torch.linalg.vector_norm(b, dim=(-2, -1))


def _row_sums(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    bias: Tensor | None,
    alpha: float,
    beta: float,
    fused: bool = False,
) -> _RowSums:
    """Row sums of ``alpha·a@b + beta·bias`` predicted from the operands, and those of ``out``.

    Eagerly, two passes over each of A, B and C (after one fp32 conversion of each
    half-precision operand); ``fused``, one over each. The magnitude Σ_k |a_ik|·Σ_j|b_kj| is
    bounded by ‖a_i‖₂·√N·‖B‖_F (Cauchy-Schwarz twice) and Σ_j|c_ij| by √N·‖c_i‖₂: both only
    scale fp32 roundoff terms, and 2-norms are the fast reductions. ``fused`` predicts the row
    sums by a product and a sum over K, which a compiler fuses with the norm of A's rows into
    one pass over A; eagerly a matrix-vector product is faster.
    """
    work = _work_dtype(out.dtype)
    k, n = a.shape[-1], b.shape[-1]
    a_ = a.to(work)
    b_ = b.to(work)  # one conversion each: reductions with dtype= convert on every call
    b_sum, b_fro = _sums_along_rows(b_, fused)
    if fused:
        expected = (a_ * b_sum.unsqueeze(-2)).sum(-1) * alpha
    else:
        expected = (a_ @ b_sum.unsqueeze(-1)).squeeze(-1) * alpha
    mag = _row_norm(a_, fused) * (b_fro * math.sqrt(n) * abs(alpha)).unsqueeze(-1)
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
    return _RowSums(expected, mag, *_sum_and_norm(out, work), k, n)


def _row_check(
    a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None, alpha: float, beta: float, sigmas: float
) -> tuple[Tensor, Tensor]:
    """Per-row |checksum error| and its rounding bound (flattened over batch and rows)."""
    sums = _row_sums(a, b, out, bias, alpha, beta)
    return _judge(sums, out, a.dtype, sigmas, out.shape[:-1])


def _nonfinite_rows(
    out: Tensor, s: _RowSums, err: Tensor, bound: Tensor, in_dtype: torch.dtype, sigmas: float
) -> tuple[Tensor, Tensor]:
    """Rows with NaN/Inf: wrong if the inputs are finite and cannot overflow, else unjudged.

    Where the squares of a row overflowed fp32 (an infinite norm), the norm is rescaled by the
    row maximum; for column groups of a grouped mm (rows of ``out`` are not the checked rows)
    such a row stays unjudged.
    """
    work = err.dtype
    c_norm = torch.broadcast_to(s.c_norm, err.shape)
    if not bool(torch.isfinite(c_norm).all()) and out.shape[:-1] == err.shape:
        c_ = out.to(work)
        scale = c_.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(work).tiny)
        c_norm = _norm(c_ / scale, -1) * scale.squeeze(-1)
        rescaled = _RowSums(s.expected, s.mag, s.c_sum, c_norm, s.k, s.n)
        bound = torch.broadcast_to(_bound(rescaled, out.dtype, in_dtype, sigmas), err.shape)
    expected = torch.broadcast_to(s.expected, err.shape)
    mag = torch.broadcast_to(s.mag, err.shape)
    out_bad = ~(torch.isfinite(torch.broadcast_to(s.c_sum, err.shape)) & torch.isfinite(c_norm))
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


def _worst_ratio(
    s: _RowSums, out_dtype: torch.dtype, in_dtype: torch.dtype, sigmas: float
) -> Tensor:
    """The largest row error over its bound, 0 for no rows; NaN or inf where a row or its bound is
    not finite (an overflowed norm bounds nothing: the full check rescales it)."""
    bound = _bound(s, out_dtype, in_dtype, sigmas)
    ratio = (s.c_sum - s.expected).abs() / bound.clamp_min(torch.finfo(bound.dtype).tiny)
    ratio = torch.where(torch.isfinite(bound), ratio, math.inf)
    return torch.cat([ratio.reshape(-1), ratio.new_zeros(1)]).amax()  # (pad specialises shapes)


def screen_matmul(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    *,
    bias: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    sigmas: float = SIGMAS,
    fused: bool = False,
) -> Tensor:
    """The worst row's checksum error over its rounding bound for ``out == alpha·a@b + beta·bias``
    (0-d, the work dtype): ``out`` passes where it is <= 1; anything else (NaN included) is for
    :func:`check_matmul` to judge and confirm. ``fused`` writes it for a compiler to fuse (one
    pass over each operand) rather than for eager execution."""
    _validate(a, b, out, bias, "screen_matmul")
    return matmul_screen(a, b, out, bias, alpha, beta, sigmas, fused)


def matmul_screen(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    bias: Tensor | None,
    alpha: float,
    beta: float,
    sigmas: float,
    fused: bool,
) -> Tensor:
    """:func:`screen_matmul` without validation, for operands a covered op was called with."""
    sums = _row_sums(a, b, out, bias, alpha, beta, fused)
    return _worst_ratio(sums, out.dtype, a.dtype, sigmas)


def screen_grouped_mm(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    *,
    offs: Tensor | None = None,
    bias: Tensor | None = None,
    sigmas: float = SIGMAS,
    fused: bool = False,
) -> Tensor:
    """:func:`screen_matmul` for ``torch._grouped_mm``, every group at once."""
    _validate_grouped(a, b, offs, "screen_grouped_mm")
    return grouped_mm_screen(a, b, out, offs, bias, sigmas, fused)


def grouped_mm_screen(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    offs: Tensor | None,
    bias: Tensor | None,
    sigmas: float,
    fused: bool,
) -> Tensor:
    """:func:`screen_grouped_mm` without validation, for operands ``_grouped_mm`` was called
    with."""
    if offs is None:
        bias = None if bias is None else bias.unsqueeze(-2)
        return matmul_screen(a, b, out, bias, 1.0, 1.0, sigmas, fused)
    sums, _ = _grouped_row_sums(a, b, out, offs, bias, fused)
    return _worst_ratio(sums, out.dtype, a.dtype, sigmas)


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


def _validate(
    a: Tensor, b: Tensor, out: Tensor, bias: Tensor | None, caller: str = "check_matmul"
) -> None:
    for name, t in (("a", a), ("b", b), ("out", out)):
        if not t.is_floating_point():
            raise TypeError(f"{caller}: {name} must be a floating tensor, got {t.dtype}")
        if t.dim() < 1 + (name != "out"):
            raise ValueError(f"{caller}: {name} must be at least 2-D, got {tuple(t.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"{caller}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: "
            "the last dim of a must equal the second-to-last dim of b"
        )
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    expected = (*batch, a.shape[-2], b.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(
            f"{caller}: out is {tuple(out.shape)}, expected {expected} for a "
            f"{tuple(a.shape)} times b {tuple(b.shape)}"
        )
    if bias is not None:
        try:
            torch.broadcast_shapes(bias.shape, out.shape)
        except RuntimeError as e:
            raise ValueError(
                f"{caller}: bias {tuple(bias.shape)} does not broadcast to out {expected}"
            ) from e


def _verdict(
    judge: Callable[[Tensor], tuple[Tensor, Tensor]],
    out: Tensor,
    recompute: Callable[[], Tensor],
    host_disagrees: Callable[[], bool],
    confirm: bool,
) -> CheckResult:
    """Judge ``out``; confirm a suspect one by recomputation, then by a host reference."""
    error, worst_bound, suspect = _worst(*judge(out))
    if not suspect:
        return CheckResult(True, error, worst_bound, False, "clean")
    if not confirm:
        return CheckResult(False, error, worst_bound, True, "unconfirmed")
    if not _worst(*judge(recompute()))[2]:
        return CheckResult(False, error, worst_bound, True, "transient")
    if host_disagrees():
        return CheckResult(False, error, worst_bound, True, "persistent")
    return CheckResult(True, error, worst_bound, True, "false_alarm")


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
        return _verdict(
            lambda c: _row_check(a, b, c, bias, alpha, beta, sigmas),
            out,
            recompute or (lambda: _recompute(a, b, bias, alpha, beta)),
            lambda: _host_reference_disagrees(a, b, out, bias, alpha, beta, sigmas),
            confirm,
        )


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
    """Split a ``torch._grouped_mm`` into per-group (a, b, out, bias) views of plain products
    (for the fp64 host reference, which only a suspect result that recomputation repeats needs)."""
    if offs is None:
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
        else:  # groups of columns
            groups.append((a[g], b[:, s:e], out[:, s:e], None if bias_g is None else bias_g[s:e]))
    return groups


MASKED_GROUPS = 16
"""Compiled, up to this many groups of a grouped mm are told apart by comparisons with each
group's ends, which a compiler fuses into the passes that use them (no ``searchsorted`` call),
and may be summed by masks (:func:`_masked_group_sums`)."""


def _masked_group_sums(groups: int, device: torch.device) -> bool:
    """Whether compiled code sums a grouped mm's groups by one masked reduction per group, which
    reads the operand once per group, rather than a scatter (``index_add``): on a CPU with more
    than one thread, up to :data:`MASKED_GROUPS` groups. There the scatter's threads contend for
    the same group's sums (atomic adds): the K-group screen of 4 groups of 512 tokens takes
    420 µs by a scatter on 2 threads and 70 µs masked (144 µs masked for 16 groups, as slow as
    the scatter from about 32). On one thread the scatter is faster (88 µs against 111 µs);
    on CUDA nothing has measured the masked form, so the scatter stays."""
    return device.type == "cpu" and torch.get_num_threads() > 1 and groups <= MASKED_GROUPS


class _Groups:
    """The groups of consecutive indices ``0..length`` that ``offs`` ends (an index past the last
    end is in no group), and sums over them: each index's group by ``searchsorted``, or compiled
    by comparisons (:data:`MASKED_GROUPS`), and the sums by a scatter (``index_add``) or by masks
    (:func:`_masked_group_sums`)."""

    def __init__(self, offs: Tensor, length: int, work: torch.dtype, fused: bool) -> None:
        self.count = offs.numel()
        self.length = length
        self.masked = fused and _masked_group_sums(self.count, offs.device)
        index = torch.arange(length, device=offs.device, dtype=offs.dtype)
        starts = torch.nn.functional.pad(offs[:-1], (1, 0))
        self.sizes = (offs - starts).to(work)  # indices per group (k or n of its products)
        if fused and self.count <= MASKED_GROUPS:
            self.index = (index.unsqueeze(-1) >= offs).sum(-1)  # (L,): the ends passed
        else:
            self.index = torch.searchsorted(offs, index, right=True)
        if self.masked:
            self.mask = (index >= starts.unsqueeze(-1)) & (index < offs.unsqueeze(-1))  # (G, L)

    def sum(self, x: Tensor) -> Tensor:
        """Sums of the rows of ``x`` (length, ...) in each group: (groups, ...)."""
        if self.masked:
            mask = self.mask.view(self.count, self.length, *(1,) * (x.dim() - 1))
            return torch.where(mask, x.unsqueeze(0), 0).sum(1)
        shape = (self.count + 1, *x.shape[1:])
        return x.new_zeros(shape).index_add(0, self.index, x)[: self.count]

    def one_hot(self, dtype: torch.dtype) -> Tensor:
        """(groups, length): 1 where an index is in the group."""
        if self.masked:
            return self.mask.to(dtype)
        one_hot = torch.nn.functional.one_hot(self.index, self.count + 1)
        return one_hot[:, : self.count].t().to(dtype)


def _grouped_row_sums(
    a: Tensor, b: Tensor, out: Tensor, offs: Tensor, bias: Tensor | None, fused: bool = False
) -> tuple[_RowSums, tuple[int, ...]]:
    """Row sums of every group of a grouped mm at once (no loop over groups), and the rows'
    shape: (rows of out) for row groups, (groups, rows) for K groups, (rows, groups) for column
    groups. Rows past the last group end belong to no group and are not judged."""
    work = _work_dtype(out.dtype)
    a_, b_ = a.to(work), b.to(work)
    if b.dim() == 3:  # groups of rows: the expert forward
        groups = _Groups(offs, a.shape[0], work, fused)
        group = groups.index
        pad = a_.new_zeros(1)  # rows of no group: zero sums and magnitude
        b_sum, b_fro = _sums_along_rows(b_, fused)
        if fused:  # a compiler gathers each row's group sums inside its one pass over A
            expected = (a_ * torch.cat([b_sum, pad.expand(1, b.shape[1])])[group]).sum(-1)
        else:  # eagerly that gather is an (M, K) fp32 temporary: rows against all groups' sums
            per_group = torch.cat([a_ @ b_sum.t(), pad.expand(a.shape[0], 1)], 1)  # (M, G+1)
            expected = per_group.gather(1, group.unsqueeze(1)).squeeze(1)
        b_fro = torch.cat([b_fro, pad])[group]
        mag = _row_norm(a_, fused) * b_fro * math.sqrt(b.shape[-1])
        if bias is not None:
            bias_ = bias.to(work)
            expected = expected + torch.cat([bias_.sum(-1), pad])[group]
            mag = mag + torch.cat([bias_.abs().sum(-1), pad])[group]
        c_sum, c_norm = _sum_and_norm(out, work)
        # Rows of no group: out's are not written and a's may be padding, any bits (NaN too).
        in_group = group < groups.count
        expected, mag, c_sum, c_norm = (
            torch.where(in_group, x, 0) for x in (expected, mag, c_sum, c_norm)
        )
        return _RowSums(expected, mag, c_sum, c_norm, a.shape[-1], b.shape[-1]), c_sum.shape
    if a.dim() == 2:  # groups along K: the expert weight gradient, out (G, M, N)
        groups = _Groups(offs, a.shape[-1], work, fused)
        a_t = a_.t()  # (K, M): contiguous for the usual transposed activations
        expected = groups.sum(a_t * b_.sum(-1, keepdim=True))  # (G, M)
        a_norm = groups.sum(a_t.square()).sqrt()
        b_fro = groups.sum(b_.square().sum(-1)).sqrt()  # (G,)
        mag = a_norm * (b_fro * math.sqrt(b.shape[-1])).unsqueeze(-1)
        if bias is not None:
            bias_ = bias.to(work)
            expected = expected + bias_.sum(-1, keepdim=True)
            mag = mag + bias_.abs().sum(-1, keepdim=True)
        c_sum, c_norm = _sum_and_norm(out, work)
        k = groups.sizes.unsqueeze(-1)
        return _RowSums(expected, mag, c_sum, c_norm, k, b.shape[-1]), c_sum.shape
    groups = _Groups(offs, b.shape[-1], work, fused)  # groups of columns, out (M, N)
    expected = torch.einsum("gmk,gk->mg", a_, groups.sum(b_.t()))
    b_fro = groups.sum(b_.square().sum(0)).sqrt()  # (G,)
    n = groups.sizes
    mag = _norm(a_, -1).t() * b_fro * n.sqrt()
    if bias is not None:
        bias_ = bias.to(work) * groups.one_hot(work)  # (G, N): each group's bias over its columns
        expected = expected + bias_.sum(-1)
        mag = mag + bias_.abs().sum(-1)
    c_ = out.to(work)
    c_sum = groups.sum(c_.t()).t()
    c_norm = groups.sum(c_.t().square()).sqrt().t()
    return _RowSums(expected, mag, c_sum, c_norm, a.shape[-1], n), c_sum.shape


def grouped_mm_routed_dims(
    a: Tensor, b: Tensor, out: Tensor, offs: Tensor | None, bias: Tensor | None, *_: Any
) -> tuple[tuple[int, ...], ...]:
    """The dims of :func:`grouped_mm_screen`'s tensor arguments (a, b, out, offs, bias) that
    the groups index: their length is the rows routed to the experts, which under expert
    parallelism changes every step. None of a batched product's (no ``offs``)."""
    if offs is None:
        return ()
    if b.dim() == 3:  # groups of rows
        return ((0,), (), (0,), (), ())
    if a.dim() == 2:  # groups along K
        return ((1,), (0,), (), (), ())
    return ((), (1,), (1,), (), (1,))  # groups of columns


def _validate_grouped(
    a: Tensor, b: Tensor, offs: Tensor | None, caller: str = "check_grouped_mm"
) -> None:
    if offs is None and (a.dim() != 3 or b.dim() != 3):
        raise ValueError(
            f"{caller}: without offs a and b must be 3-D, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if offs is not None and (a.dim(), b.dim()) not in ((2, 3), (2, 2), (3, 2)):
        raise ValueError(
            f"{caller}: unsupported shapes {tuple(a.shape)} x {tuple(b.shape)} with offs"
        )


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
    """Check ``out == torch._grouped_mm(a, b, offs=offs, bias=bias)``, every group at once.

    The result is that of the worst row of any group; a suspect result is recomputed by
    ``torch._grouped_mm`` and, if still suspect, compared group by group with an fp64 host
    reference.
    """
    _validate_grouped(a, b, offs)

    def judge(c: Tensor) -> tuple[Tensor, Tensor]:
        if offs is None:
            return _row_check(a, b, c, None if bias is None else bias.unsqueeze(-2), 1, 1, sigmas)
        sums, rows = _grouped_row_sums(a, b, c, offs, bias)
        return _judge(sums, c, a.dtype, sigmas, rows)

    def host_disagrees() -> bool:
        return any(
            _host_reference_disagrees(a_g, b_g, out_g, bias_g, 1.0, 1.0, sigmas)
            for a_g, b_g, out_g, bias_g in grouped_mm_groups(a, b, out, offs, bias)
        )

    with torch.no_grad():
        return _verdict(
            judge,
            out,
            lambda: torch._grouped_mm(a, b, offs=offs, bias=bias),
            host_disagrees,
            confirm,
        )
