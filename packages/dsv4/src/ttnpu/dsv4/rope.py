"""Partial, trailing, interleaved rotary embedding with optional YaRN, and its inverse.

Only the last ``rope_dim`` channels rotate, pairing channels (2k, 2k+1) as the released weights
need.
The inverse rotation (position -t) is applied to the attention output, because K = V carries the
keys' absolute rotation into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RopeTable", "apply_rope", "rope_frequencies"]


def _correction_dim(n_rot: float, dim: int, base: float, seq_len: int) -> float:
    return dim * math.log(seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(
    dim: int,
    base: float,
    *,
    yarn_factor: float | None = None,
    original_seq_len: int = 0,
    beta_fast: int = 32,
    beta_slow: int = 1,
) -> torch.Tensor:
    """Inverse frequencies [dim // 2]; with YaRN, blend interpolated and original frequencies
    over the correction range (no mscale: DeepSeek-V4 keeps the softmax scale and cos/sin)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn_factor is None:
        return freqs.float()
    low = max(math.floor(_correction_dim(beta_fast, dim, base, original_seq_len)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, original_seq_len)), dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    smooth = 1 - ramp
    return (freqs / yarn_factor * (1 - smooth) + freqs * smooth).float()


@dataclass(frozen=True)
class RopeTable:
    """cos/sin [S, rope_dim // 2] for positions ``start .. start + S - 1`` of one forward pass
    (``start`` > 0 on a context-parallel rank's slice), and the frequencies they come from."""

    cos: torch.Tensor
    sin: torch.Tensor
    inv_freq: torch.Tensor
    start: int = 0

    @classmethod
    def build(
        cls, inv_freq: torch.Tensor, seq_len: int, device: torch.device, start: int = 0
    ) -> RopeTable:
        positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.to(device=device, dtype=torch.float32))
        return cls(angles.cos(), angles.sin(), inv_freq, start)

    def span(self, start: int, stop: int) -> RopeTable:
        """The table of positions ``start .. stop - 1`` (same frequencies)."""
        return RopeTable.build(self.inv_freq, stop - start, self.cos.device, start)

    def rows(self, start: int, stop: int) -> RopeTable:
        """Rows ``start .. stop - 1`` of this table (positions ``self.start + start ..``)."""
        return RopeTable(
            self.cos[start:stop], self.sin[start:stop], self.inv_freq, self.start + start
        )

    def every(self, stride: int, count: int) -> RopeTable:
        """The rows of positions start, start + stride, ... (compressed entry s sits at s * m)."""
        return RopeTable(
            self.cos[::stride][:count], self.sin[::stride][:count], self.inv_freq, self.start
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x with its trailing ``2 * cos.shape[-1]`` channels, as pairs (x0, x1), replaced by
    ``(x0 cos - x1 sin, x0 sin + x1 cos)`` (fp32 math or wider, written in x's dtype)."""
    half = cos.shape[-1]
    rope_dim = 2 * half
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


class _Rope(torch.autograd.Function):
    """The rotation is orthogonal: its backward is the rotation by the opposite angle. Saves
    only the tables."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, table: RopeTable, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x [..., S, (heads,) D].

    ``table`` rows align with x's sequence axis: axis -2 for [B, S, D] and -3 for [B, S, H, D]
    (pass ``x`` with the head axis last-but-one and cos/sin are broadcast over heads)."""
    cos, sin = table.cos, table.sin
    if x.dim() == 4:  # [B, S, H, D]: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    out: torch.Tensor = _Rope.apply(x, cos, sin)
    return out
