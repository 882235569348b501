"""RMS norms: the weighted one of every sub-layer and the un-weighted one of q heads and mHC.

Both are one autograd node with a hand-written backward that saves only the input (as given)
and the per-row rsqrt: eager autograd would save an fp32 copy and the normalised product too,
and run about twice as many passes over the rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["RMSNorm", "rms_norm_backward", "rms_norm_forward", "rms_normalize"]


def _rsqrt_mean_square(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis, [..., 1]."""
    return xf.square().mean(-1, keepdim=True).add_(eps).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (``w`` None: un-weighted), in x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        out, rs = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rs)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rs = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(grad, x, weight, rs, ctx.needs_input_grad[1])
        return grad_x, grad_weight, None


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``w * x / sqrt(mean(x^2) + eps)`` in x's dtype, the fp32 rsqrt [..., 1] its backward
    needs with x): the math of :class:`_RMSNorm`, for nodes that fuse a norm (mHC's)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rs = _rsqrt_mean_square(xf, eps)
    out = xf * rs
    if weight is not None:
        out.mul_(weight)  # fp32 weight: w * (x * rs), as the reference computes it
    return out.to(x.dtype), rs


def rms_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rs: torch.Tensor,
    weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x's gradient in x's dtype, the weight's or None) of :func:`rms_norm_forward`."""
    normed = x.to(rs.dtype) * rs
    grad = grad.to(rs.dtype)
    grad_weight = None
    if weight is not None:
        if weight_grad:
            grad_weight = (grad * normed).reshape(-1, normed.shape[-1]).sum(0)
            grad_weight = grad_weight.to(weight.dtype)
        grad = grad * weight
    # d/dx [x rs] . g = rs * (g - x_hat * mean(g * x_hat)).
    dot = (grad * normed).mean(-1, keepdim=True)
    return torch.addcmul(grad, normed, dot, value=-1).mul_(rs).to(x.dtype), grad_weight


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, computed in fp32, returned in x's dtype."""
    out: torch.Tensor = _RMSNorm.apply(x, None, eps)
    return out


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (fp32 weight), cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _RMSNorm.apply(x, self.weight, self.eps)
        return out

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
