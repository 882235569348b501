"""Manifold-constrained hyper-connections: n residual streams mixed by a doubly-stochastic matrix.

Each site computes ``pre`` (collapse the streams into the sub-layer input), ``post`` (expand the
sub-layer output) and ``comb`` (Sinkhorn-projected stream mixer, applied transposed) from the
RMS-normalised flattened streams; ``hc_head`` collapses the streams before the final norm.

Every function here is one autograd node with a hand-written backward: the math is a few dozen
tiny ops per site (most of them on [tokens, n, n] tensors), which eager autograd would run as
one node each. The small per-token quantities are kept token-last (``[rows, tokens]``), so every
elementwise op and every reduction over the n x n matrix runs over contiguous token vectors.
"""

from __future__ import annotations

from typing import Any

import torch

from .norms import rms_norm_backward, rms_norm_forward

__all__ = ["hc_head", "hc_post", "hc_pre", "sinkhorn"]


# Sinkhorn, on token-last [n, n, T] tensors ------------------------------------------------------
def _axes(iters: int) -> list[int]:
    """Normalisation axes of a token-last [i, j, T] matrix after the softmax: columns (sum over
    i, axis 0), then (rows (axis 1), columns) x (iters - 1)."""
    return [0, *([1, 0] * (iters - 1))]


def _normalise(
    probs: torch.Tensor, iters: int, eps: float
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The normalisations of ``_axes`` after the softmax: (comb, each step's (output,
    denominator)). The backward calls it again: the same ops, so the forward's values bit for
    bit, and nothing but the softmax is kept for it."""
    comb = probs + eps
    steps = []
    for axis in _axes(iters):
        denominator = comb.sum(dim=axis, keepdim=True).add_(eps)
        comb = comb / denominator
        steps.append((comb, denominator))
    return comb, steps


def _sinkhorn_forward(
    logits: torch.Tensor, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, n, T] -> (comb, probs): softmax over j (+eps), then ``_normalise``."""
    probs = torch.softmax(logits, dim=1)
    return _normalise(probs, iters, eps)[0], probs


def _sinkhorn_backward(
    grad: torch.Tensor, probs: torch.Tensor, iters: int, eps: float
) -> torch.Tensor:
    """The gradient of the logits [n, n, T] from that of comb (contiguous [n, n, T]).
    ``d/dc [c / (sum(c) + eps)] . g = (g - sum(g * y)) / (sum(c) + eps)`` per step."""
    _, steps = _normalise(probs, iters, eps)
    for axis, (out, denominator) in zip(reversed(_axes(iters)), reversed(steps), strict=True):
        grad = (grad - (grad * out).sum(dim=axis, keepdim=True)).div_(denominator)
    return torch._softmax_backward_data(grad, probs, 1, probs.dtype)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        n = logits.shape[-1]
        token_last = logits.reshape(-1, n, n).permute(1, 2, 0).contiguous()
        comb, probs = _sinkhorn_forward(token_last, iters, eps)
        ctx.save_for_backward(probs)
        ctx.iters, ctx.eps, ctx.shape = iters, eps, logits.shape
        return _token_major(comb, logits.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (probs,) = ctx.saved_tensors
        n = ctx.shape[-1]
        grad = grad.reshape(-1, n, n).permute(1, 2, 0).contiguous()
        grad = _sinkhorn_backward(grad, probs, ctx.iters, ctx.eps)
        return grad.permute(2, 0, 1).reshape(ctx.shape), None, None


def _token_major(rows: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` [..., k] or [..., n, n] (never a view, which a
    custom Function must not return) from a token-last [k, T] or [n, n, T] one."""
    out = rows.new_empty(shape)
    out.view(-1, *rows.shape[:-1]).copy_(rows.movedim(-1, 0))
    return out


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The official order: softmax over rows (+eps), normalise columns, then ``iters - 1`` rounds
    of row then column normalisation. The result is doubly stochastic up to ``eps`` once it has
    converged (20 iterations suffice for logits in [-1, 1])."""
    out: torch.Tensor = _Sinkhorn.apply(logits, iters, eps)
    return out


# hc_pre / hc_head ---------------------------------------------------------------------------------
class _Collapse(torch.autograd.Function):
    """One mHC site's pre side: ``mix = (flat @ fn^T) * rsqrt(mean(flat^2) + norm_eps)``, the
    gates ``pre = sigmoid(mix * s0 + b) + eps`` (and, when fn has (2 + n) n rows, ``post = 2
    sigmoid(...)`` and ``comb = sinkhorn(...)``), and ``u = sum_i pre_i x_i``, RMS-normalised
    by the sub-layer's norm when ``norm_weight`` is given.

    Saves x as given (no fp32 copy), the [rows, T] mixes and gates, the per-token rsqrt and the
    Sinkhorn softmax (its normalisations are recomputed in the backward); with the norm, only
    its per-token rsqrt: the backward recomputes u (one [T, n] x [n, d] product) instead of the
    norm keeping it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
        norm_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        *lead, n, d = x.shape
        rows = fn.shape[0]
        full = rows == (2 + n) * n
        compute = _compute_dtype(x)
        flat = x.reshape(-1, n * d).to(compute)
        tokens = flat.shape[0]
        rs = torch.linalg.vector_norm(flat, dim=-1).square_().div_(n * d).add_(norm_eps).rsqrt_()
        # [rows, T]; never in place on a matmul's output (selective AC may have saved it)
        mixes = (fn.to(compute) @ flat.t()) * rs
        scales = _scale_column(scale.to(compute), n, full)
        logits = torch.addcmul(base.to(compute).unsqueeze(-1), mixes, scales)
        gates = torch.sigmoid(logits[: 2 * n] if full else logits)  # [2n or n, T]
        pre = (gates[:n] + eps).t().contiguous()  # [T, n]
        u = torch.bmm(pre.unsqueeze(1), flat.view(tokens, n, d)).view(*lead, d).to(x.dtype)
        norm_rs = x.new_empty(0, dtype=compute)
        if norm_weight is not None:
            u, norm_rs = rms_norm_forward(u, norm_weight, norm_eps)
        if full:
            post = _token_major(2 * gates[n:], (*lead, n))
            comb_logits = logits[2 * n :].view(n, n, tokens)
            comb, probs = _sinkhorn_forward(comb_logits, iters, eps)
            comb_out = _token_major(comb, (*lead, n, n))
        else:
            post, comb_out, probs = (x.new_empty(0, dtype=compute) for _ in range(3))
        ctx.save_for_backward(x, fn, scales, rs, mixes, gates, pre, probs, norm_weight, norm_rs)
        ctx.full, ctx.iters, ctx.eps = full, iters, eps
        ctx.dtypes = fn.dtype, base.dtype, scale.dtype
        return u, post, comb_out

    @staticmethod
    def backward(
        ctx: Any, grad_u: torch.Tensor, grad_post: torch.Tensor, grad_comb: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, fn, scales, rs, mixes, gates, pre, probs, norm_weight, norm_rs = ctx.saved_tensors
        n, d = x.shape[-2:]
        full = ctx.full
        compute = _compute_dtype(x)
        flat = x.reshape(-1, n * d).to(compute)
        tokens = flat.shape[0]
        stacked = flat.view(tokens, n, d)
        grad_norm_weight = None
        if norm_weight is not None:
            u = torch.bmm(pre.unsqueeze(1), stacked).view(*norm_rs.shape[:-1], d).to(x.dtype)
            grad_u, grad_norm_weight = rms_norm_backward(
                grad_u, u, norm_weight, norm_rs, ctx.needs_input_grad[7]
            )
            del u
        grad_u = grad_u.reshape(tokens, 1, d).to(compute)
        grad_pre = (stacked * grad_u).sum(dim=-1)  # [T, n]
        if full:
            grad_post = grad_post.reshape(tokens, n).t().to(compute) * 2
            grad_gates = torch.cat((grad_pre.t(), grad_post))
            grad_comb = grad_comb.reshape(tokens, n, n).permute(1, 2, 0).to(compute).contiguous()
            grad_sinkhorn = _sinkhorn_backward(grad_comb, probs, ctx.iters, ctx.eps)
            grad_logits = torch.cat(
                (
                    torch.ops.aten.sigmoid_backward(grad_gates, gates),
                    grad_sinkhorn.view(n * n, tokens),
                )
            )
        else:
            grad_logits = torch.ops.aten.sigmoid_backward(grad_pre.t(), gates)
        grad_base = grad_logits.sum(dim=-1)
        grad_scales = (grad_logits * mixes).sum(dim=-1)
        grad_scale = torch.stack([part.sum() for part in _groups(grad_scales, n, full)])
        grad_mixes = grad_logits.mul_(scales)
        grad_rs = (grad_mixes * mixes).sum(dim=0).div_(rs)  # d loss / d rsqrt, per token
        grad_raw = grad_mixes.mul_(rs)  # d loss / d (fn @ flat^T)
        grad_fn = grad_raw @ flat
        grad_flat = grad_raw.t() @ fn.to(compute)
        # rsqrt(mean(flat^2) + eps): d rs / d flat = -rs^3 flat / D.
        grad_flat.addcmul_(flat, (rs.pow(3).mul_(grad_rs).div_(-n * d)).unsqueeze(-1))
        grad_x = grad_flat.view(tokens, n, d).addcmul_(pre.unsqueeze(-1), grad_u)
        fn_dtype, base_dtype, scale_dtype = ctx.dtypes
        return (
            grad_x.view(x.shape).to(x.dtype),
            grad_fn.to(fn_dtype),
            grad_base.to(base_dtype),
            grad_scale.to(scale_dtype),
            None,
            None,
            None,
            grad_norm_weight,
        )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower activations (the mixes are fp32 islands), else x's."""
    return torch.promote_types(x.dtype, torch.float32)


def _scale_column(scale: torch.Tensor, n: int, full: bool) -> torch.Tensor:
    """Each mix row's scale, as a [rows, 1] column: s0 for pre, s1 for post, s2 for comb."""
    if not full:
        return scale[:1].expand(n).unsqueeze(-1)
    parts = [scale[0:1].expand(n), scale[1:2].expand(n), scale[2:3].expand(n * n)]
    return torch.cat(parts).unsqueeze(-1)


def _groups(rows: torch.Tensor, n: int, full: bool) -> list[torch.Tensor]:
    return list(rows.split([n, n, n * n])) if full else [rows]


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    iters: int,
    eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, S, n, d] -> (u [B, S, d], post [B, S, n], comb [B, S, n, n]); u RMS-normalised
    (eps ``norm_eps``) and scaled by ``norm_weight`` when given: the sub-layer's input norm,
    fused so that u itself is not kept for the backward."""
    u, post, comb = _Collapse.apply(x, fn, base, scale, iters, eps, norm_eps, norm_weight)
    return u, post, comb


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Collapse [B, S, n, d] to [B, S, d] with sigmoid weights (no post, no comb); normalised as
    :func:`hc_pre`'s u when ``norm_weight`` is given."""
    u: torch.Tensor = _Collapse.apply(x, fn, base, scale, 0, eps, norm_eps, norm_weight)[0]
    return u


# hc_post ------------------------------------------------------------------------------------------
class _Expand(torch.autograd.Function):
    """``X'_j = post_j * F + sum_i comb[i, j] X_i``; saves f, x, post and comb as given."""

    @staticmethod
    def forward(
        ctx: Any, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[-2]
        dtype = x.dtype
        combined = comb.reshape(-1, n, n).to(dtype).transpose(-1, -2)
        mixed = torch.bmm(combined, _stacked(x))  # baddbmm_ would loop over tokens
        # Out of place: selective activation checkpointing may have saved the bmm's output, and
        # the result must be a new tensor, not a view.
        out = torch.addcmul(mixed.view(x.shape), post.to(dtype).unsqueeze(-1), f.unsqueeze(-2))
        ctx.save_for_backward(f, x, post, comb)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, x, post, comb = ctx.saved_tensors
        n, d = x.shape[-2:]
        dtype = x.dtype
        grad = grad.reshape(-1, n, d)
        needs = ctx.needs_input_grad
        grad_f = grad_x = grad_post = grad_comb = None
        if needs[0]:
            grad_f = torch.bmm(post.reshape(-1, 1, n).to(dtype), grad).view(f.shape)
        if needs[1]:
            grad_x = torch.bmm(comb.reshape(-1, n, n).to(dtype), grad).view(x.shape)
        if needs[2]:
            grad_post = (grad * f.reshape(-1, 1, d)).sum(dim=-1)
            grad_post = grad_post.view(post.shape).to(post.dtype)
        if needs[3]:
            grad_comb = torch.bmm(_stacked(x), grad.transpose(-1, -2))
            grad_comb = grad_comb.view(comb.shape).to(comb.dtype)
        return grad_f, grad_x, grad_post, grad_comb


def _stacked(x: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] as a contiguous [T, n, d] (the first block's streams are one row expanded
    n times, which bmm would otherwise multiply one token at a time)."""
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def hc_post(
    f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``X'_j = post_j * F + sum_i comb[i, j] X_i`` (the residual mixer is comb transposed)."""
    out: torch.Tensor = _Expand.apply(f, x, post, comb)
    return out
