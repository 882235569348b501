"""The memory-bounded formulation, on any device: queries in chunks, each chunk's attention
recomputed in the backward (``torch.utils.checkpoint``), so what waits for the backward is the
chunk's inputs and output, never its scores.

Within a chunk of c queries, one fp32 softmax spans the window keys ``[c, H, W]``, the compressed
entries and the sink. On CSA layers the entries are the indexer's top-k, gathered by index
(``[c, H, k]`` scores); on HCA layers and in the indexer's dense warm-up they are the entries
visible to the chunk's last query (``[c, H, n]``, masked per query). The indexer's selection runs
in query chunks and key blocks (:func:`.selection.select_topk`), and its distillation loss is
computed per chunk, from the scores at the entries the chunk reads. The chunk length follows
``chunk_logits``: at most that many logits (queries x heads x keys), plus the gathered entries
and indexer keys on CSA layers, per chunk.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ttnpu.dsv4.compressor import indexer_kl_rows

from . import AttentionInputs
from .masks import visible_count, visible_entries, window_mask
from .selection import gather_picked, gathered_index_scores, index_scores, select_topk

__all__ = ["chunked_attention"]


def chunked_attention(inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, shard, ix, entries = inputs.q, inputs.shard, inputs.indexer, inputs.entries
    length, heads = q.shape[1], q.shape[2]
    picks = None
    per_query = heads * (inputs.window + 1)  # logits (and, when gathered, entry elements)
    if entries is not None and entries.shape[1] == 0:
        entries = None  # a sequence shorter than one block
    if entries is not None:
        if ix is not None and ix.sparse:
            picks = select_topk(ix, shard.start, inputs.ratio, inputs.chunk_logits)
            k = picks.shape[-1]
            per_query += heads * k + k * (entries.shape[-1] + ix.keys.shape[-1])
        else:
            per_query += heads * entries.shape[1]
    rows = max(1, min(length, inputs.chunk_logits // per_query))
    outs: list[torch.Tensor] = []
    kl_sum = q.new_zeros((), dtype=torch.float32)
    rows_read = torch.zeros((), dtype=torch.long, device=q.device)
    for t0 in range(0, length, rows):
        t1 = min(t0 + rows, length)
        start = shard.start + t0
        chunk_entries = entries
        if entries is not None and picks is None:  # the entries the chunk's last query sees
            seen = min(visible_count(start + t1 - t0 - 1, inputs.ratio), entries.shape[1])
            chunk_entries = entries[:, :seen] if seen else None
        out, kl, read = checkpoint(
            _attend_chunk,
            q[:, t0:t1],
            inputs.keys[:, t0 : t1 + inputs.window - 1],
            inputs.sink,
            chunk_entries,
            None if picks is None else picks[:, t0:t1],
            None if ix is None else ix.q[:, t0:t1],
            None if ix is None else ix.weights[:, t0:t1],
            None if ix is None else ix.keys,
            scale=inputs.scale,
            ratio=inputs.ratio,
            start=start,
            use_reentrant=False,
        )
        outs.append(out)
        if ix is not None:
            kl_sum = kl_sum + kl
            rows_read = rows_read + read
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if ix is None:
        return out, None
    return out, kl_sum / shard.sum(rows_read).clamp_min(1)


def _attend_chunk(
    q: torch.Tensor,
    keys: torch.Tensor,
    sink: torch.Tensor,
    entries: torch.Tensor | None,
    picks: torch.Tensor | None,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
    index_keys: torch.Tensor | None,
    *,
    scale: float,
    ratio: int,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Output [B, c, H, D], the summed indexer KL of the chunk's queries, how many of them read
    an entry) for queries at positions ``start ..``; ``keys`` [B, c + W - 1, D]; ``entries``
    every entry the chunk may read, or with ``picks`` [B, c, k] (-1: none) all of them."""
    batch, count, heads, dim = q.shape
    window_size = keys.shape[1] - count + 1
    window = keys.unfold(1, window_size, 1)  # [B, c, D, W]; slot w: key t - W + 1 + w
    scores = [torch.matmul(q, window)]
    masks = [window_mask(count, window_size, q.device, start).unsqueeze(1)]
    selected = reads = None
    if entries is not None:
        if picks is not None:
            reads = picks >= 0  # [B, c, k]
            at = picks.clamp_min(0)
            selected = gather_picked(entries, at)  # [B, c, k, D]
            scores.append(torch.matmul(q, selected.transpose(-1, -2)))
        else:
            reads = visible_entries(count, entries.shape[1], ratio, q.device, start)  # [c, n]
            flat = torch.bmm(q.reshape(batch, count * heads, dim), entries.transpose(1, 2))
            scores.append(flat.view(batch, count, heads, -1))
        masks.append(reads.unsqueeze(-2))
    logits = [
        (score.float() * scale).masked_fill(~mask, float("-inf"))
        for score, mask in zip(scores, masks, strict=True)
    ]
    sink_logits = sink.float().view(1, 1, -1, 1).expand(batch, count, heads, 1)
    probs = torch.softmax(torch.cat((*logits, sink_logits), dim=-1), dim=-1)
    kl = probs.new_zeros(())
    read = torch.zeros((), dtype=torch.long, device=q.device)
    if index_q is not None and entries is not None and reads is not None:
        assert index_weights is not None and index_keys is not None
        if picks is not None:
            index_keys = gather_picked(index_keys, picks.clamp_min(0))
            index = gathered_index_scores(index_q, index_weights, index_keys)
        else:
            index = index_scores(index_q, index_weights, index_keys[:, : entries.shape[1]])
        mass = probs[..., window_size:-1].sum(dim=-2)
        kl_rows, rows = indexer_kl_rows(index, mass, reads)
        kl, read = kl_rows.sum(), rows.sum()
    probs = probs.to(keys.dtype)
    out = torch.matmul(probs[..., :window_size], window.transpose(-1, -2))
    if selected is not None:
        out = out + torch.matmul(probs[..., window_size:-1], selected)
    elif entries is not None:
        entry_probs = probs[..., window_size:-1].reshape(batch, count * heads, -1)
        out = out + torch.bmm(entry_probs, entries).view_as(out)
    return out, kl, read
