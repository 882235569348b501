"""The lightning indexer's top-k selection, computed in query chunks and key blocks so that no
``[S, N]`` score matrix is ever formed.

Key blocks are fixed ranges of entries (``[0, b), [b, 2b), ...``, whatever the queries), merged
block by block with ``torch.topk`` as transformers' indexer selects over a whole row: the picks,
ties included, are a function of each query's scores alone, the same for every query chunking,
backend and context-parallel split, and identical to transformers' while N <= b.
"""

from __future__ import annotations

import math

import torch

from . import IndexerInputs
from .masks import visible_count, visible_entries

__all__ = [
    "gather_picked",
    "gathered_index_scores",
    "index_scores",
    "picks_mask",
    "select_topk",
]


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Index scores [B, c, n] of queries ``q`` [B, c, IH, ID] (head ``weights`` [B, c, IH]) over
    ``keys`` [B, n, ID] shared by every query."""
    batch, count, heads, _ = q.shape
    logits = torch.bmm(q.reshape(batch, count * heads, -1), keys.transpose(1, 2)).relu()
    return torch.matmul(weights.unsqueeze(-2), logits.view(batch, count, heads, -1)).squeeze(-2)


def gathered_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Index scores [B, c, k] of queries ``q`` [B, c, IH, ID] over their own ``keys``
    [B, c, k, ID]."""
    logits = torch.matmul(q, keys.transpose(-1, -2)).relu()  # [B, c, IH, k]
    return torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2)


@torch.no_grad()
def select_topk(ix: IndexerInputs, start: int, ratio: int, select_logits: int) -> torch.Tensor:
    """Long [B, L, k] (k = min(topk, N)): each query's top-k visible entries by index score,
    best first; -1 where fewer than k are visible. ``start``: the position of the first query;
    ``select_logits``: how many scores (queries x heads x entries) one step may hold."""
    batch, length, heads, _ = ix.q.shape
    n = ix.keys.shape[1]
    k = min(ix.topk, n)
    picks = torch.full((batch, length, k), -1, dtype=torch.long, device=ix.q.device)
    if k == 0:
        return picks
    rows_per_chunk = max(1, math.isqrt(select_logits // heads))
    block = max(k, select_logits // (rows_per_chunk * heads))
    for t0 in range(0, length, rows_per_chunk):
        t1 = min(t0 + rows_per_chunk, length)
        seen = min(visible_count(start + t1 - 1, ratio), n)
        best = ix.q.new_full((batch, t1 - t0, 0), float("-inf"))
        best_at = picks.new_empty((batch, t1 - t0, 0))
        for s0 in range(0, seen, block):
            s1 = min(s0 + block, n)
            scores = index_scores(ix.q[:, t0:t1], ix.weights[:, t0:t1], ix.keys[:, s0:s1])
            visible = visible_entries(t1 - t0, s1 - s0, ratio, scores.device, start + t0, s0)
            scores = scores.masked_fill(~visible, float("-inf"))
            at = torch.arange(s0, s1, device=scores.device).expand_as(scores)
            merged = torch.cat((best, scores), dim=-1)
            order = merged.topk(min(k, merged.shape[-1]), dim=-1).indices
            best = merged.gather(-1, order)
            best_at = torch.cat((best_at, at), dim=-1).gather(-1, order)
        found = best_at.masked_fill(best.isneginf(), -1)
        picks[:, t0:t1, : found.shape[-1]] = found
    return picks


def picks_mask(picks: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Bool [B, L, N] from :func:`select_topk`'s picks."""
    mask = torch.zeros(*picks.shape[:-1], n_entries + 1, dtype=torch.bool, device=picks.device)
    mask.scatter_(-1, picks.masked_fill(picks < 0, n_entries), True)
    return mask[..., :n_entries]


def gather_picked(rows: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """``rows`` [B, N, D] at ``picks`` [B, c, k] (no -1) -> [B, c, k, D]."""
    batch, count, k = picks.shape
    flat = picks.reshape(batch, count * k, 1).expand(-1, -1, rows.shape[-1])
    return rows.gather(1, flat).view(batch, count, k, -1)
