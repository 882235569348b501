"""KV compressors (CSA overlapping, HCA non-overlapping), the lightning indexer of CSA and its
distillation loss.

A compressor turns every complete block of ``ratio`` tokens into one entry: a per-channel softmax
over the block's gate logits (plus a learned position bias ``ape``) weights the block's projected
kv. With ``overlap`` (CSA, ratio 4) each entry also reads the previous block through the first half
of the 2c-wide projections, giving windows of 2m tokens at stride m. Entry s gets RoPE at s * m and
is visible to query t iff ``s < (t + 1) // m`` (see :func:`.backends.masks.visible_entries`).

Top-k is not differentiable and the indexer's inputs are detached, so the indexer learns only from
:func:`indexer_kl` (DSA / V3.2 distillation towards the main attention), and that loss never
reaches the main model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .backends import IndexerInputs
from .context_parallel import SequenceShard, compressor_halo
from .norms import RMSNorm
from .rope import RopeTable, apply_rope

__all__ = ["Compressor", "Indexer", "indexer_kl", "indexer_kl_rows"]


def _fp32_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` computed in fp32 even when mixed precision (FSDP's param_dtype) has cast
    the weight to bf16."""
    return F.linear(x.float(), linear.weight.float())


class Compressor(nn.Module):
    """Projections in fp32; ``overlap`` doubles their width (previous-block | own-block half)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = nn.Linear(dim, width, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(dim, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x [B, S, dim] -> entries [B, S // ratio, head_dim] (trailing partial block dropped)."""
        batch, seq_len, _ = x.shape
        m, c = self.ratio, self.head_dim
        n = seq_len // m
        if n == 0:
            return x.new_zeros(batch, 0, c)
        xs = x[:, : n * m].float()
        kv = _fp32_linear(xs, self.wkv).view(batch, n, m, -1)
        gate = _fp32_linear(xs, self.wgate).view(batch, n, m, -1) + self.ape.float()
        if self.overlap:
            # Slots [0, m) read block i-1 through the first half; block -1 is empty (gate -inf).
            prev_kv = F.pad(kv[:, :-1, :, :c], (0, 0, 0, 0, 1, 0))
            prev_gate = F.pad(gate[:, :-1, :, :c], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat((prev_kv, kv[..., c:]), dim=2)
            gate = torch.cat((prev_gate, gate[..., c:]), dim=2)
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        entries = self.norm(pooled)
        return apply_rope(entries, rope.every(m, n)).to(x.dtype)

    def sequence_entries(
        self, x: torch.Tensor, rope: RopeTable, shard: SequenceShard
    ) -> torch.Tensor:
        """Every entry of the sequence [B, length // ratio, head_dim] from this rank's slice
        ``x`` [B, L, dim]: the rank compresses the blocks that end in its slice, reading the
        tokens before it (and, with overlap, the block before) from the previous rank, then the
        entries of all ranks are gathered."""
        m = self.ratio
        rows = compressor_halo(shard.start, m, self.overlap)
        most = max(compressor_halo(start, m, self.overlap) for start, _ in shard.bounds)
        halo = shard.halo(x, rows, f"compressed blocks of {m} tokens", sent=most)
        begin = shard.start - rows
        own = self(torch.cat((halo, x), dim=1), rope.span(begin, shard.stop))
        return shard.gather_entries(own[:, shard.start // m - begin // m :], m)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.wkv.weight, std=std)
        nn.init.normal_(self.wgate.weight, std=std)
        nn.init.zeros_(self.ape)
        self.norm.reset_parameters()


class Indexer(nn.Module):
    """Lightning indexer: ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s])``; the attention reads
    the top-k visible entries of each query by this score. Its inputs are detached: top-k gives
    the LM loss no gradient path, and its own objective (:func:`indexer_kl`) must not train the
    main model. The scores themselves are computed by the attention backend, from the factors
    this module returns."""

    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.ratio, self.topk = n_heads, head_dim, ratio, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False, dtype=torch.float32)
        self.compressor = Compressor(dim, head_dim, ratio, overlap=True, eps=eps)
        self.scale = head_dim**-0.5 * n_heads**-0.5

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        rope: RopeTable,
        shard: SequenceShard | None = None,
        *,
        sparse: bool = True,
    ) -> IndexerInputs:
        """The score's factors for this slice's queries (``shard``: this rank's slice, default
        the whole sequence) over every entry; ``sparse`` False: the dense warm-up."""
        x, qr = x.detach(), qr.detach()
        batch, seq_len, _ = x.shape
        shard = shard or SequenceShard.whole(seq_len)
        keys = self.compressor.sequence_entries(x, rope, shard).float()
        q = self.wq_b(qr).view(batch, seq_len, self.n_heads, self.head_dim)
        q = apply_rope(q, rope).float()
        weights = _fp32_linear(x.float(), self.weights_proj) * self.scale
        return IndexerInputs(q, keys, weights, self.topk, sparse)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.wq_b.weight, std=std)
        nn.init.normal_(self.weights_proj.weight, std=std)
        self.compressor.reset_parameters(std)


def indexer_kl_rows(
    index: torch.Tensor, attention_mass: torch.Tensor, reads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``KL(p_t || softmax(I_t))`` per query [..., S], bool [..., S]: the queries that read at
    least one entry; the KL of the others is 0). ``index`` [..., S, K] are the indexer scores of
    K entries (the only input with a gradient); ``attention_mass`` [..., S, K] is the main
    attention's probability on each of them summed over heads; its restriction to ``reads``
    (bool, broadcastable), L1-normalised and detached, is the target p."""
    reads = reads.expand(index.shape)
    target = attention_mass.detach().float().masked_fill(~reads, 0.0)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    # Finite fill, not -inf: a row without entries stays finite (and is left out of the mean).
    logits = index.float().masked_fill(~reads, torch.finfo(torch.float32).min)
    kl = (torch.xlogy(target, target) - target * logits.log_softmax(dim=-1)).sum(dim=-1)
    rows = reads.any(dim=-1)
    return kl * rows, rows


def indexer_kl(
    index: torch.Tensor,
    attention_mass: torch.Tensor,
    reads: torch.Tensor,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """:func:`indexer_kl_rows` averaged over the queries that read at least one entry (a mean,
    so the weight does not depend on batch or length). Under context parallelism (``shard``)
    the queries are this rank's and the mean is over the whole sequence's: the result is this
    rank's share of it."""
    kl, rows = indexer_kl_rows(index, attention_mass, reads)
    count = rows.sum() if shard is None else shard.sum(rows.sum())
    return kl.sum() / count.clamp_min(1)
