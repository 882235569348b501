"""DeepSeek-V4 attention: low-rank query, one shared 512-d KV head (K = V), per-head q RMS norm,
learned sink, grouped output projection; the sliding window plus, per layer, compressed entries
(HCA: all visible ones; CSA: the lightning indexer's top-k of them).

This module computes the projections, the compressed entries and the indexer's factors, and the
output projection; the attention core between them (one softmax over window keys, entries and
sink, and the indexer's distillation loss) is computed by the configured backend
(:mod:`ttnpu.dsv4.backends`, ``attention_backend``).
"""

from __future__ import annotations

import torch
from torch import nn

from .backends import AttentionInputs, attend
from .compressor import Compressor, Indexer
from .config import DeepSeekV4Config
from .context_parallel import SequenceShard
from .norms import RMSNorm
from .rope import RopeTable, apply_rope

__all__ = ["Attention"]


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
        self.backend, self.chunk_logits = c.attention_backend, c.attention_chunk_logits
        self.select_logits = c.index_select_logits
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
        kv = apply_rope(self.kv_norm(self.wkv(x)), rope)
        # The window's keys: the W - 1 before the slice (zeros before the sequence start, masked
        # by the backends) come from the previous rank under context parallelism.
        halo = shard.halo(kv, self.window - 1, f"{self.window}-token sliding window")
        entries = indexer = None
        if self.compressor is not None:
            entries = self.compressor.sequence_entries(x, rope, shard)
            if self.indexer is not None:
                indexer = self.indexer(x, qr, rope, shard, sparse=not self.dense_indexer_warmup)
        inputs = AttentionInputs(
            q=q,
            keys=torch.cat((halo, kv), dim=1),
            window=self.window,
            sink=self.attn_sink,
            scale=self.softmax_scale,
            shard=shard,
            entries=entries,
            ratio=self.ratio,
            indexer=indexer,
            chunk_logits=self.chunk_logits,
            select_logits=self.select_logits,
            q_rope=rope,
            q_eps=self.eps,
        )
        out, indexer_loss = attend(self.backend, inputs)
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
