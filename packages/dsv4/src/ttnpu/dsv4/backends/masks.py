"""Which keys a query may read: its sliding window, and the compressed entries whose source block
has ended."""

from __future__ import annotations

import torch

__all__ = ["visible_entries", "window_mask"]


def window_mask(seq_len: int, window: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """Bool [S, W] over the banded keys of queries at positions ``start ..``: slot w of query t
    is key ``t - window + 1 + w``, valid when >= 0 (the window includes t)."""
    t = torch.arange(start, start + seq_len, device=device).unsqueeze(1)
    w = torch.arange(window, device=device).unsqueeze(0)
    return t - window + 1 + w >= 0


def visible_entries(
    seq_len: int,
    n_entries: int,
    ratio: int,
    device: torch.device,
    start: int = 0,
    first: int = 0,
) -> torch.Tensor:
    """Bool [S, N]: query t (positions ``start ..``) may read entry s (``first ..``) iff its
    source block ends at or before t."""
    t = torch.arange(start, start + seq_len, device=device).unsqueeze(1)
    s = torch.arange(first, first + n_entries, device=device).unsqueeze(0)
    return s < (t + 1) // ratio


def visible_count(position: int, ratio: int) -> int:
    """How many entries the query at ``position`` may read."""
    return (position + 1) // ratio
