"""RMS norms: the weighted one of every sub-layer and the un-weighted one of q heads and mHC."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "rms_normalize"]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, computed in fp32, returned in x's dtype."""
    scale = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * scale.to(x.dtype)


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (fp32 weight), cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
