"""Manifold-constrained hyper-connections: n residual streams mixed by a doubly-stochastic matrix.

Each site computes ``pre`` (collapse the streams into the sub-layer input), ``post`` (expand the
sub-layer output) and ``comb`` (Sinkhorn-projected stream mixer, applied transposed) from the
RMS-normalised flattened streams; ``hc_head`` collapses the streams before the final norm.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["hc_head", "hc_post", "hc_pre", "sinkhorn"]


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn with a hand-written backward: the 2 * iters tiny normalisations would otherwise
    cost one autograd node each, which dominates mHC on CPU. Saves each step's output and
    denominator; ``d/dc [c / (sum(c) + eps)] . g = (g - sum(g * y)) / (sum(c) + eps)``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        comb = probs + eps
        saved = [probs]
        for dim in _axes(iters):
            denominator = comb.sum(dim=dim, keepdim=True) + eps
            comb = comb / denominator
            saved += [comb, denominator]
        ctx.save_for_backward(*saved)
        ctx.iters = iters
        return comb

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, *steps = ctx.saved_tensors
        for k, dim in reversed(list(enumerate(_axes(ctx.iters)))):
            out, denominator = steps[2 * k], steps[2 * k + 1]
            grad = (grad - (grad * out).sum(dim=dim, keepdim=True)) / denominator
        return probs * (grad - (grad * probs).sum(dim=-1, keepdim=True)), None, None


def _axes(iters: int) -> list[int]:
    """Normalisation axes after the softmax: columns, then (rows, columns) x (iters - 1)."""
    return [-2, *([-1, -2] * (iters - 1))]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The official order: softmax over rows (+eps), normalise columns, then ``iters - 1`` rounds
    of row then column normalisation. The result is doubly stochastic up to ``eps`` once it has
    converged (20 iterations suffice for logits in [-1, 1])."""
    out: torch.Tensor = _Sinkhorn.apply(logits, iters, eps)
    return out


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = x.flatten(-2).float()
    rs = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return (flat @ fn.float().t()) * rs


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, S, n, d] -> (u [B, S, d], post [B, S, n], comb [B, S, n, n])."""
    n = x.shape[-2]
    mix = _mixes(x, fn, norm_eps)
    pre_m, post_m, comb_m = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_m * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_m * scale[1] + post_b)
    comb = sinkhorn((comb_m * scale[2] + comb_b).unflatten(-1, (n, n)), iters, eps)
    u = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return u, post, comb


def hc_post(
    f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``X'_j = post_j * F + sum_i comb[i, j] X_i`` (the residual mixer is comb transposed)."""
    dtype = x.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + mixed


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Collapse [B, S, n, d] to [B, S, d] with sigmoid weights (no post, no comb)."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale[0] + base.float()) + eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
