"""DeepSeek-V4 attention: low-rank query, one shared 512-d KV head (K = V), per-head q RMS norm,
learned sink, grouped output projection; the sliding window plus, per layer, compressed entries
(HCA: all visible ones; CSA: the lightning indexer's top-k of them).

Training-time formulation: one softmax per query over its window keys (a banded view of the
sequence, ``t - window < j <= t``), the compressed entries masked by visibility (and indexer
selection), and the sink, one more logit with a zero value. On CSA layers the forward also returns
the indexer's distillation loss against this softmax's mass on the compressed entries; with
``indexer_stage="dense"`` (warm-up) every visible entry is read instead of the indexer's top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor, Indexer, indexer_kl, visible_entries
from .config import DeepSeekV4Config
from .context_parallel import SequenceShard
from .norms import RMSNorm, rms_normalize
from .rope import RopeTable, apply_rope

__all__ = ["Attention", "window_mask"]


def window_mask(seq_len: int, window: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """Bool [S, W] over the banded keys of :func:`_windows` for queries at positions ``start ..``:
    slot w of query t is key ``t - window + 1 + w``, valid when >= 0 (the window includes t)."""
    t = torch.arange(start, start + seq_len, device=device).unsqueeze(1)
    w = torch.arange(window, device=device).unsqueeze(0)
    return t - window + 1 + w >= 0


def _windows(kv: torch.Tensor, window: int, shard: SequenceShard) -> torch.Tensor:
    """[B, L, D] -> [B, L, D, W] view: the ``window`` keys ending at each position of the slice;
    the ``window - 1`` before it come from the previous rank (zeros before the sequence start,
    masked by :func:`window_mask`)."""
    padded = torch.cat((shard.halo(kv, window - 1, f"{window}-token sliding window"), kv), dim=1)
    return padded.unfold(1, window, 1)


class Attention(nn.Module):
    def __init__(self, config: DeepSeekV4Config, ratio: int) -> None:
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.ratio = c.n_heads, c.head_dim, ratio
        self.window, self.o_groups, self.eps = c.window_size, c.o_groups, c.norm_eps
        self.softmax_scale = c.head_dim**-0.5
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        group_in = c.n_heads * c.head_dim // c.o_groups
        self.wo_a = nn.Linear(group_in, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(c.n_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        self.dense_indexer_warmup = c.indexer_stage == "dense"
        if ratio:
            csa = config.is_csa(ratio)
            self.compressor = Compressor(c.dim, c.head_dim, ratio, overlap=csa, eps=c.norm_eps)
            if csa:
                self.indexer = Indexer(
                    c.dim,
                    c.q_lora_rank,
                    c.index_n_heads,
                    c.index_head_dim,
                    ratio,
                    c.index_topk,
                    c.norm_eps,
                )

    def forward(
        self, x: torch.Tensor, rope: RopeTable, shard: SequenceShard | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, L, dim] -> (output [B, L, dim], the indexer's KL on CSA layers, else None).
        ``shard``: where x's L tokens lie in the sequence (default: they are all of it)."""
        batch, seq_len, _ = x.shape
        shard = shard or SequenceShard.whole(seq_len)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(batch, seq_len, self.n_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.eps), rope)
        kv = apply_rope(self.kv_norm(self.wkv(x)), rope)

        # Window branch, banded: query t scores its `window` most recent keys only. Scores are
        # laid out [B, S, H, keys] so both branches are plain batched matmuls.
        window = _windows(kv, self.window, shard)  # [B, L, D, W]; slot w: key t - W + 1 + w
        scores = [torch.matmul(q, window)]
        masks = [window_mask(seq_len, self.window, x.device, shard.start).unsqueeze(1)]
        entries = index = None
        if self.compressor is not None:
            entries = self.compressor.sequence_entries(x, rope, shard)
            reads = visible_entries(seq_len, entries.shape[1], self.ratio, x.device, shard.start)
            if self.indexer is not None:
                index = self.indexer.scores(x, qr, rope, shard)
                if not self.dense_indexer_warmup:
                    reads = self.indexer.select(index)
            flat_q = q.reshape(batch, seq_len * self.n_heads, -1)
            scores.append(torch.bmm(flat_q, entries.transpose(1, 2)).view(*q.shape[:3], -1))
            masks.append(reads.unsqueeze(-2))
        # Softmax and sink in fp32 whatever the activation dtype (the report's precision recipe);
        # the probabilities are cast back for the value matmuls.
        logits = [
            (score.float() * self.softmax_scale).masked_fill(~mask, float("-inf"))
            for score, mask in zip(scores, masks, strict=True)
        ]
        sink = self.attn_sink.float().view(1, 1, -1, 1).expand(*q.shape[:3], 1)
        probs = torch.softmax(torch.cat((*logits, sink), dim=-1), dim=-1)
        indexer_loss = None
        if index is not None:
            mass = probs[..., self.window : -1].sum(dim=-2)
            indexer_loss = indexer_kl(index, mass, reads, shard)
        probs = probs.to(kv.dtype)
        out = torch.matmul(probs[..., : self.window], window.transpose(-1, -2))
        if entries is not None:
            entry_probs = probs[..., self.window : -1].reshape(batch, seq_len * self.n_heads, -1)
            out = out + torch.bmm(entry_probs, entries).view_as(out)
        out = apply_rope(out, rope, inverse=True)

        grouped = out.reshape(batch, seq_len, self.o_groups, -1)
        wo_a = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])
        mixed = torch.einsum("bsgd,grd->bsgr", grouped, wo_a)
        return self.wo_b(mixed.flatten(2)), indexer_loss

    def reset_parameters(self, std: float) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            nn.init.normal_(linear.weight, std=std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
        nn.init.zeros_(self.attn_sink)
        if self.compressor is not None:
            self.compressor.reset_parameters(std)
        if self.indexer is not None:
            self.indexer.reset_parameters(std)
