"""The indexer's distillation loss for backends whose fused attention returns only its softmax
normalisers (``flex``, ``npu``): per query chunk, the attention's mass on the entries each query
reads is recomputed from the log-sum-exp (no gradient), and the KL against the index scores at
those entries is taken with the indexer's gradient, the chunk recomputed in the backward."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ttnpu.dsv4.compressor import indexer_kl_rows

from . import AttentionInputs
from .masks import visible_count, visible_entries
from .selection import gather_picked, gathered_index_scores, index_scores

__all__ = ["indexer_loss_from_lse"]


def indexer_loss_from_lse(
    inputs: AttentionInputs,
    entries: torch.Tensor,
    picks: torch.Tensor | None,
    lse_total: torch.Tensor,
) -> torch.Tensor:
    """This rank's share of the indexer KL, per query chunk (each recomputed in the backward),
    given the attention's softmax normalisers ``lse_total`` [B, L, H] (sink included): the
    entries read are ``picks`` [B, L, k] (-1: none), or every visible entry when None."""
    q, ix, start = inputs.q.detach(), inputs.indexer, inputs.shard.start
    assert ix is not None
    length, heads, n = q.shape[1], q.shape[2], entries.shape[1]
    per_query = n if picks is None else picks.shape[-1]
    rows = max(1, min(length, inputs.chunk_logits // (heads * per_query)))
    kl_sum = q.new_zeros((), dtype=torch.float32)
    rows_read = torch.zeros((), dtype=torch.long, device=q.device)
    for t0 in range(0, length, rows):
        t1 = min(t0 + rows, length)
        seen = n
        if picks is None:  # the entries the chunk's last query sees
            seen = min(visible_count(start + t1 - 1, inputs.ratio), n)
            if seen == 0:
                continue
        kl, read = checkpoint(
            _chunk_kl,
            q[:, t0:t1],
            lse_total[:, t0:t1],
            entries.detach()[:, :seen],
            None if picks is None else picks[:, t0:t1],
            ix.q[:, t0:t1],
            ix.weights[:, t0:t1],
            ix.keys[:, :seen],
            scale=inputs.scale,
            ratio=inputs.ratio,
            start=start + t0,
            use_reentrant=False,
        )
        kl_sum = kl_sum + kl
        rows_read = rows_read + read
    return kl_sum / inputs.shard.sum(rows_read).clamp_min(1)


def _chunk_kl(
    q: torch.Tensor,
    lse_total: torch.Tensor,
    entries: torch.Tensor,
    picks: torch.Tensor | None,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    index_keys: torch.Tensor,
    *,
    scale: float,
    ratio: int,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Summed KL, how many queries read an entry) of queries ``q`` [B, c, H, D] at positions
    ``start ..``, whose softmax normalisers (sink included) are ``lse_total`` [B, c, H]."""
    batch, count, heads, dim = q.shape
    with torch.no_grad():
        if picks is not None:
            reads = picks >= 0  # [B, c, k]
            at = picks.clamp_min(0)
            scores = torch.matmul(q, gather_picked(entries, at).transpose(-1, -2))  # [B, c, H, k]
        else:
            reads = visible_entries(count, entries.shape[1], ratio, q.device, start)  # [c, n]
            flat = torch.bmm(q.reshape(batch, count * heads, dim), entries.transpose(1, 2))
            scores = flat.view(batch, count, heads, -1)
        probs = torch.exp(scores.float() * scale - lse_total.unsqueeze(-1))
        mass = probs.masked_fill(~reads.unsqueeze(-2), 0.0).sum(dim=-2)
    if picks is not None:
        keys = gather_picked(index_keys, picks.clamp_min(0))
        index = gathered_index_scores(index_q, index_weights, keys)
    else:
        index = index_scores(index_q, index_weights, index_keys)
    kl_rows, rows = indexer_kl_rows(index, mass, reads)
    return kl_rows.sum(), rows.sum()
