"""The dense, masked formulation: one softmax per query over its W window keys (a banded view of
the keys), every compressed entry (masked by visibility and, on CSA layers, by the indexer's
selection) and the sink. It forms ``[B, S, H, N]`` scores and the indexer's ``[B, S, N]``: kept as
the plain statement of the function, for parity tests."""

from __future__ import annotations

import torch

from ttnpu.dsv4.compressor import indexer_kl

from . import AttentionInputs
from .masks import visible_entries, window_mask
from .selection import index_scores, picks_mask, select_topk

__all__ = ["reference_attention"]


def reference_attention(inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, shard, ix = inputs.q, inputs.shard, inputs.indexer
    batch, length, heads, _ = q.shape
    window = inputs.keys.unfold(1, inputs.window, 1)  # [B, L, D, W]; slot w: key t - W + 1 + w
    scores = [torch.matmul(q, window)]
    masks = [window_mask(length, inputs.window, q.device, shard.start).unsqueeze(1)]
    entries, index, reads = inputs.entries, None, None
    if entries is not None:
        n = entries.shape[1]
        reads = visible_entries(length, n, inputs.ratio, q.device, shard.start)
        if ix is not None:
            index = index_scores(ix.q, ix.weights, ix.keys)
            index = index.masked_fill(~reads, float("-inf"))
            if ix.sparse:
                picks = select_topk(ix, shard.start, inputs.ratio, inputs.select_logits)
                reads = picks_mask(picks, n)
        flat_q = q.reshape(batch, length * heads, -1)
        scores.append(torch.bmm(flat_q, entries.transpose(1, 2)).view(*q.shape[:3], -1))
        masks.append(reads.unsqueeze(-2))
    # Softmax and sink in fp32 whatever the activation dtype (the report's precision recipe);
    # the probabilities are cast back for the value matmuls.
    logits = [
        (score.float() * inputs.scale).masked_fill(~mask, float("-inf"))
        for score, mask in zip(scores, masks, strict=True)
    ]
    sink = inputs.sink.float().view(1, 1, -1, 1).expand(*q.shape[:3], 1)
    probs = torch.softmax(torch.cat((*logits, sink), dim=-1), dim=-1)
    indexer_loss = None
    if index is not None and reads is not None:
        mass = probs[..., inputs.window : -1].sum(dim=-2)
        indexer_loss = indexer_kl(index, mass, reads, shard)
    probs = probs.to(inputs.keys.dtype)
    out = torch.matmul(probs[..., : inputs.window], window.transpose(-1, -2))
    if entries is not None:
        entry_probs = probs[..., inputs.window : -1].reshape(batch, length * heads, -1)
        out = out + torch.bmm(entry_probs, entries).view_as(out)
    return out, indexer_loss
