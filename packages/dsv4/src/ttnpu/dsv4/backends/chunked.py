"""The memory-bounded formulation, on any device: queries in chunks, each chunk's attention
recomputed in the backward (``torch.utils.checkpoint``), so what waits for the backward is the
chunk's inputs and output, never its scores.

Within a chunk of c queries, one fp32 softmax spans the window keys, the compressed entries and
the sink. The window is computed in query blocks of W rows, each against the 2W - 1 keys its
rows can read, as one batched matmul (``[c, H, 2W - 1]`` scores, masked to each row's band):
twice the window's multiply-adds, but in matmuls of W x H rows instead of one small matmul per
query. On HCA layers and in the indexer's dense warm-up the entries are those visible to the
chunk's last query (``[c, H, n]``, masked per query). On CSA layers they are the indexer's top-k:
gathered by index (``[c, H, k]`` scores, ``[c, k, D]`` gathered entries) or, while that would
hold more than scoring every visible entry and masking all but the picks (n visible entries with
(H + IH + 1) n <= k (H + D + IH + ID): short sequences), masked; the two compute the same
function. The indexer's selection runs in
query chunks and key blocks (:func:`.selection.select_topk`), and its distillation loss is
computed per chunk, from the scores at the entries the chunk reads. The chunk length follows
``chunk_logits``: at most that many logits (queries x heads x keys), plus the gathered entries
and indexer keys on CSA layers, per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ttnpu.dsv4.compressor import indexer_kl_rows
from ttnpu.dsv4.norms import rms_normalize
from ttnpu.dsv4.rope import RopeTable, apply_rope

from . import AttentionInputs
from .masks import visible_count, visible_entries
from .selection import gather_picked, gathered_index_scores, index_scores, picks_mask, select_topk

__all__ = ["chunked_attention"]


def chunked_attention(inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, shard, ix, entries = inputs.q, inputs.shard, inputs.indexer, inputs.entries
    length, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    picks = None
    per_query = heads * 2 * inputs.window  # logits (and, when gathered, entry elements)
    # Per query of a CSA chunk: what gathering holds (logits, entries, index keys and scores),
    # and what masking holds per visible entry (logits, index scores, the picks mask).
    gathered = masked = 0
    if entries is not None and entries.shape[1] == 0:
        entries = None  # a sequence shorter than one block
    if entries is not None:
        if ix is not None and ix.sparse:
            picks = select_topk(ix, shard.start, inputs.ratio, inputs.select_logits)
            k = picks.shape[-1]
            index_heads, index_dim = ix.q.shape[2], ix.q.shape[3]
            gathered = heads * k + k * dim + index_heads * k + k * index_dim
            masked = heads + index_heads + 1
            per_query += gathered
        else:
            per_query += heads * entries.shape[1]
    rows = max(1, min(length, inputs.chunk_logits // per_query))
    outs: list[torch.Tensor] = []
    kl_sum = q.new_zeros((), dtype=torch.float32)
    rows_read = torch.zeros((), dtype=torch.long, device=q.device)
    for t0 in range(0, length, rows):
        t1 = min(t0 + rows, length)
        start = shard.start + t0
        chunk_entries, chunk_picks, dense_picks = entries, None, False
        if entries is not None:  # the entries the chunk's last query sees
            seen = min(visible_count(start + t1 - t0 - 1, inputs.ratio), entries.shape[1])
            if picks is not None:
                chunk_picks = picks[:, t0:t1]
                dense_picks = masked * seen <= gathered
            if picks is None or dense_picks:
                chunk_entries = entries[:, :seen] if seen else None
        out, kl, read = checkpoint(
            _attend_chunk,
            q[:, t0:t1],
            inputs.keys[:, t0 : t1 + inputs.window - 1],
            inputs.sink,
            chunk_entries,
            chunk_picks,
            None if ix is None else ix.q[:, t0:t1],
            None if ix is None else ix.weights[:, t0:t1],
            None if ix is None else ix.keys,
            None if inputs.q_rope is None else inputs.q_rope.rows(t0, t1),
            eps=inputs.q_eps,
            scale=inputs.scale,
            ratio=inputs.ratio,
            start=start,
            dense_picks=dense_picks,
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
    rope: RopeTable | None,
    *,
    eps: float,
    scale: float,
    ratio: int,
    start: int,
    dense_picks: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Output [B, c, H, D], the summed indexer KL of the chunk's queries, how many of them read
    an entry) for queries at positions ``start ..``; ``keys`` [B, c + W - 1, D]. ``entries``:
    those the chunk may read; with ``picks`` [B, c, k] (-1: none) every entry, unless
    ``dense_picks`` (the visible ones, masked to the picks). ``rope``: q is still to be
    normalised and rotated (:meth:`AttentionInputs.queries`)."""
    if rope is not None:
        q = apply_rope(rms_normalize(q, eps), rope)
    batch, count, heads, dim = q.shape
    window = keys.shape[1] - count + 1
    blocks, pad = -(-count // window), (-count) % window
    # Query block j (rows jW .. jW + W - 1) reads keys jW .. jW + 2W - 2 of ``keys``.
    band_keys = F.pad(keys, (0, 0, 0, pad)).unfold(1, 2 * window - 1, window)  # [B, n, D, 2W-1]
    q_blocks = F.pad(q, (0, 0, 0, 0, 0, pad)).view(batch, blocks, window * heads, dim)
    band = torch.matmul(q_blocks, band_keys).view(batch, blocks * window, heads, -1)
    scores = [band[:, :count]]
    masks = [_band_mask(count, window, q.device, start).unsqueeze(1)]
    selected = reads = None
    if entries is not None:
        if picks is not None and not dense_picks:
            reads = picks >= 0  # [B, c, k]
            at = picks.clamp_min(0)
            selected = gather_picked(entries, at)  # [B, c, k, D]
            scores.append(torch.matmul(q, selected.transpose(-1, -2)))
        else:
            n = entries.shape[1]
            if picks is not None:
                reads = picks_mask(picks, n)  # [B, c, n]
            else:
                reads = visible_entries(count, n, ratio, q.device, start)  # [c, n]
            flat = torch.bmm(q.reshape(batch, count * heads, dim), entries.transpose(1, 2))
            scores.append(flat.view(batch, count, heads, -1))
        masks.append(reads.unsqueeze(-2))
    logits = [
        (score.float() * scale).masked_fill(~mask, float("-inf"))
        for score, mask in zip(scores, masks, strict=True)
    ]
    sink_logits = sink.float().view(1, 1, -1, 1).expand(batch, count, heads, 1)
    probs = torch.softmax(torch.cat((*logits, sink_logits), dim=-1), dim=-1)
    span = band.shape[-1]
    kl = probs.new_zeros(())
    read = torch.zeros((), dtype=torch.long, device=q.device)
    if index_q is not None and entries is not None and reads is not None:
        assert index_weights is not None and index_keys is not None
        if selected is not None:
            assert picks is not None
            index_keys = gather_picked(index_keys, picks.clamp_min(0))
            index = gathered_index_scores(index_q, index_weights, index_keys)
        else:
            index = index_scores(index_q, index_weights, index_keys[:, : entries.shape[1]])
        mass = probs[..., span:-1].sum(dim=-2)
        kl_rows, rows = indexer_kl_rows(index, mass, reads)
        kl, read = kl_rows.sum(), rows.sum()
    probs = probs.to(keys.dtype)
    band_probs = F.pad(probs[..., :span], (0, 0, 0, 0, 0, pad))
    band_probs = band_probs.view(batch, blocks, window * heads, span)
    out = torch.matmul(band_probs, band_keys.transpose(-1, -2))
    out = out.view(batch, blocks * window, heads, dim)[:, :count]
    if selected is not None:
        out = out + torch.matmul(probs[..., span:-1], selected)
    elif entries is not None:
        entry_probs = probs[..., span:-1].reshape(batch, count * heads, -1)
        out = out + torch.bmm(entry_probs, entries).view_as(out)
    return out, kl, read


def _band_mask(count: int, window: int, device: torch.device, start: int) -> torch.Tensor:
    """Bool [c, 2W - 1]: row r (position ``start + r``) of a block of W rows reads slot s of
    the block's keys (position ``start + (r - r % W) - W + 1 + s``) iff it is one of the W keys
    that end at r and lies at or after the sequence start."""
    r = torch.arange(count, device=device).unsqueeze(1)
    s = torch.arange(2 * window - 1, device=device).unsqueeze(0)
    offset = s - r % window
    position = start + r - r % window - window + 1 + s
    return (offset >= 0) & (offset < window) & (position >= 0)
