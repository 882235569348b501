"""The attention core on Ascend NPUs, through torch_npu's fused DeepSeek-sparse-attention operators.

Every torch_npu call sits in :class:`NpuKernels` (one method per operator, ``torch_npu`` imported
when it is built); the backend above it is plain torch. What is delegated and what is not:

- the indexer's top-k (CSA, sparse stage): ``npu_lightning_indexer``, one query per batch row
  over the entries in pages (``PA_BSND``; ``actual_seq_lengths_key`` = the query's visible count,
  ``sparse_mode`` 3); otherwise :func:`.selection.select_topk`.
- one softmax over the window keys and the entries read: ``npu_sparse_flash_attention`` over
  ``[window keys, entries]``, each query's keys listed in ``sparse_indices`` (``sparse_block_size``
  1, ``sparse_mode`` 0, ``attention_mode`` 2 with zero rope parts), in query chunks
  (``chunk_logits`` bounds the lists); backward ``npu_sparse_flash_attention_grad``.
- the sink: torch, from the operator's ``softmax_max`` / ``softmax_sum`` (no documented torch_npu
  operator takes a sink).
- the indexer KL, sparse stage: ``npu_sparse_lightning_indexer_grad_kl_loss`` (loss and gradients
  in one call), the sink folded into ``softmax_sum``; dense warm-up (its KL spans every visible
  entry, not a top-k list): torch, per query chunk, from the softmax statistics
  (:func:`.flex.indexer_loss_from_lse`).

**The sink.** With ``lse = softmax_max + log(softmax_sum)`` (natural log of the row's sum over
its keys) the sink's share gives ``out' = out * sigmoid(lse - s_h)``. Backward: for any key j,
``dL/dz_j = p_j (dO_fa . v_j - dO_fa . O_fa)`` with ``dO_fa = sigmoid(lse - s_h) * dO'`` and
``O_fa = out'``, which is exactly the flash-attention backward the grad operator computes from
``(d_out, out, softmax_max, softmax_sum)``: it is called with those two; the sink's gradient is
``-sum (1 - sigmoid) * (dO' . out')``.

**Constraints** (documented; outside them the layer runs :func:`.chunked.chunked_attention`, or,
for the indexer alone, the chunked selection and KL): query, key and
value bf16 / fp16 (fp32 activations run chunked; the indexer's fp32 factors are cast to the
activations' dtype, so the top-k is taken over rounded scores, and ties may be broken otherwise
than by ``torch.topk``); head dim 512 (the operator's query / key D) with a 64-wide zero rope
part; 1 to 128 query heads (a power of two); indexer 64 heads of 128; top-k 1 .. 2048.

**Assumptions the npu-marked test checks on hardware** (the documents leave them open):
``softmax_max`` is of the scaled scores; ``npu_lightning_indexer`` pads a row with -1 past its
visible entries; ``npu_sparse_lightning_indexer_grad_kl_loss`` normalises the target over the
rows' ``sparse_indices`` and sums the KL over queries (a query without a valid index adds 0),
honours ``sparse_mode`` 0 (no causal mask: the entries axis is not the query axis) and takes
int32 indices and fp32 statistics (as its example does; its table says bf16).

Sources: ``docs/context/torch_npu-npu_lightning_indexer.md``,
``torch_npu-npu_sparse_flash_attention.md`` and
``torch_npu-npu_sparse_lightning_indexer_grad_kl_loss.md`` in Ascend/op-plugin (the torch_npu API
reference on hiascend.com); the grad operator's signature from torch_npu's meta registrations
(``npu_sparse_flash_attention_grad``), as TorchTitan-NPU's DSA converter calls it. DeepSeek-V4's
own fused operator (sink, window and compression ratio in one kernel: MindSpeed's
``SparseAttnSharedKV``) has no published interface document, so it is not used.
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Any

import torch

from . import AttentionInputs, IndexerInputs
from .chunked import chunked_attention
from .indexer_loss import indexer_loss_from_lse
from .masks import visible_count
from .selection import select_topk

__all__ = ["NpuKernels", "npu_attention"]

MISSING = (
    "attention_backend='npu' needs torch_npu (pip install 'ttnpu-dsv4[npu]') and an Ascend device"
)


class NpuKernels:
    """The torch_npu operators, with the constraints their documents state."""

    head_dim = 512  # query / key / value D of npu_sparse_flash_attention
    rope_dim = 64  # its query_rope / key_rope D
    query_heads = (1, 2, 4, 8, 16, 32, 64, 128)
    index_heads = 64  # npu_lightning_indexer: query N
    index_dim = 128  # and D
    max_topk = 2048  # its sparse_count
    max_page = 1024  # PA_BSND block_size: a multiple of 16, at most 1024

    def __init__(
        self,
        torch_npu: ModuleType | Any | None = None,
        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16),
    ) -> None:
        self.torch_npu: Any = torch_npu if torch_npu is not None else _import_torch_npu()
        self.dtypes = dtypes

    def fits_attention(self, q: torch.Tensor) -> bool:
        heads, dim = q.shape[2], q.shape[3]
        return q.dtype in self.dtypes and dim == self.head_dim and heads in self.query_heads

    def fits_indexer(self, ix: IndexerInputs, k: int) -> bool:
        heads, dim = ix.q.shape[2], ix.q.shape[3]
        return heads == self.index_heads and dim == self.index_dim and 1 <= k <= self.max_topk

    def lightning_indexer(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        *,
        actual_seq_lengths_key: torch.Tensor,
        block_table: torch.Tensor,
        sparse_count: int,
    ) -> torch.Tensor:
        """``sparse_indices`` [B, 1, 1, sparse_count] of one query per batch row (``query``
        [B, 1, N, D], ``weights`` [B, 1, N]) over its ``actual_seq_lengths_key`` keys, paged:
        ``key`` [blocks, block_size, 1, D], ``block_table`` [B, blocks per row]."""
        indices, _ = self.torch_npu.npu_lightning_indexer(
            query,
            key,
            weights,
            actual_seq_lengths_query=None,
            actual_seq_lengths_key=actual_seq_lengths_key,
            block_table=block_table,
            layout_query="BSND",
            layout_key="PA_BSND",
            sparse_count=sparse_count,
            sparse_mode=3,
            return_value=False,
        )
        return indices

    def sparse_flash_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        sparse_indices: torch.Tensor,
        scale_value: float,
        *,
        query_rope: torch.Tensor,
        key_rope: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out [B, S1, N, D], softmax_max, softmax_sum [B, 1, S1, N]) of each query over the
        keys its row of ``sparse_indices`` [B, S1, 1, K] lists (valid first, then -1);
        K = V = ``key`` [B, S2, 1, D]."""
        out, softmax_max, softmax_sum = self.torch_npu.npu_sparse_flash_attention(
            query,
            key,
            key,
            sparse_indices,
            scale_value,
            query_rope=query_rope,
            key_rope=key_rope,
            sparse_block_size=1,
            layout_query="BSND",
            layout_kv="BSND",
            sparse_mode=0,
            attention_mode=2,
            return_softmax_lse=True,
        )
        return out, softmax_max, softmax_sum

    def sparse_flash_attention_grad(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        sparse_indices: torch.Tensor,
        d_out: torch.Tensor,
        out: torch.Tensor,
        softmax_max: torch.Tensor,
        softmax_sum: torch.Tensor,
        scale_value: float,
        *,
        query_rope: torch.Tensor,
        key_rope: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d_query, d_key + d_value) of :meth:`sparse_flash_attention`."""
        d_query, d_key, d_value, _, _ = self.torch_npu.npu_sparse_flash_attention_grad(
            query,
            key,
            key,
            sparse_indices,
            d_out,
            out,
            softmax_max,
            softmax_sum,
            scale_value,
            1,
            query_rope=query_rope,
            key_rope=key_rope,
            layout="BSND",
            sparse_mode=0,
            attention_mode=2,
        )
        return d_query, d_key + d_value

    def sparse_lightning_indexer_grad_kl_loss(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        query_index: torch.Tensor,
        key_index: torch.Tensor,
        weights: torch.Tensor,
        sparse_indices: torch.Tensor,
        softmax_max: torch.Tensor,
        softmax_sum: torch.Tensor,
        scale_value: float,
        *,
        query_rope: torch.Tensor,
        key_rope: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(d_query_index, d_key_index, d_weights, loss): the summed KL of the attention's mass
        on each query's ``sparse_indices`` against the softmax of its index scores there."""
        d_query_index, d_key_index, d_weights, loss = (
            self.torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
                query,
                key,
                query_index,
                key_index,
                weights,
                sparse_indices,
                softmax_max,
                softmax_sum,
                scale_value,
                query_rope=query_rope,
                key_rope=key_rope,
                layout="BSND",
                sparse_mode=0,
            )
        )
        return d_query_index, d_key_index, d_weights, loss


def _import_torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise RuntimeError(MISSING) from err


@functools.cache
def _torch_npu_kernels() -> NpuKernels:
    return NpuKernels()


def _kernels_for(device: torch.device) -> NpuKernels:
    kernels = _torch_npu_kernels()
    if device.type != "npu":
        raise RuntimeError(f"{MISSING}; got {device.type} tensors")
    return kernels


def npu_attention(
    inputs: AttentionInputs, kernels: NpuKernels | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backend; ``kernels`` default: torch_npu's, for tensors on an Ascend device."""
    if kernels is None:
        kernels = _kernels_for(inputs.q.device)
    q, shard, ix, entries = inputs.q, inputs.shard, inputs.indexer, inputs.entries
    if not kernels.fits_attention(q):
        return chunked_attention(inputs)
    length = q.shape[1]
    if entries is not None and entries.shape[1] == 0:
        entries = None
    picks = None
    if entries is not None and ix is not None and ix.sparse:
        picks = _select(inputs, kernels)
        if picks.shape[-1] == 0:
            entries = picks = None
    kv = inputs.keys if entries is None else torch.cat((inputs.keys, entries), dim=1)
    kv = kv.unsqueeze(2).contiguous()  # [B, S2, 1, D]
    per_query = inputs.window  # the index list's width, what a chunk holds per query
    if picks is not None:
        per_query += picks.shape[-1]
    elif entries is not None:
        per_query += entries.shape[1]
    rows = max(1, min(length, inputs.chunk_logits // per_query))
    outs, maxima, sums = [], [], []
    for t0 in range(0, length, rows):
        t1 = min(t0 + rows, length)
        indices = _read_indices(
            inputs, t0, t1, None if entries is None else entries.shape[1], picks
        )
        out, softmax_max, softmax_sum = _SparseAttention.apply(
            kernels, q[:, t0:t1].contiguous(), kv, inputs.sink, indices, inputs.scale
        )
        outs.append(out)
        maxima.append(softmax_max)
        sums.append(softmax_sum)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if ix is None:
        return out, None
    if entries is None:
        return out, q.new_zeros((), dtype=torch.float32)
    softmax_max = torch.cat(maxima, dim=2)  # [B, 1, L, H]
    # The sink's exp(s_h - max) joins each row's sum: the probabilities of the whole softmax.
    sink = inputs.sink.detach().float()
    softmax_sum = torch.cat(sums, dim=2) + torch.exp(sink - softmax_max)
    k = 0 if picks is None else picks.shape[-1]
    if picks is not None and kernels.fits_indexer(ix, k):
        count = shard.sum((picks >= 0).any(dim=-1).sum()).clamp_min(1)
        index = (ix.q, ix.keys, ix.weights)
        main = (q.detach(), entries.detach(), softmax_max, softmax_sum)
        return out, _IndexerKl.apply(kernels, *index, *main, picks, inputs.scale, count)
    lse = (softmax_max + softmax_sum.log()).squeeze(1)  # [B, L, H]
    return out, indexer_loss_from_lse(inputs, entries, picks, lse)


def _select(inputs: AttentionInputs, kernels: NpuKernels) -> torch.Tensor:
    """Long [B, L, k] (k = min(topk, N)): each query's top-k visible entries, -1 past them."""
    ix, start, ratio = inputs.indexer, inputs.shard.start, inputs.ratio
    assert ix is not None
    batch, length, heads, dim = ix.q.shape
    n = ix.keys.shape[1]
    k = min(ix.topk, n)
    if not kernels.fits_indexer(ix, k):
        return select_topk(ix, start, ratio, inputs.select_logits)
    dtype = inputs.q.dtype
    with torch.no_grad():
        # One query per batch row: its visible count is its key length (rightDownCausal with
        # one query reads all of them); every row of a sequence pages the same entries.
        page = min(kernels.max_page, 16 * math.ceil(n / 16))
        pages = math.ceil(n / page)
        keys = ix.keys.new_zeros(batch, pages * page, dim, dtype=dtype)
        keys[:, :n] = ix.keys
        positions = torch.arange(start + 1, start + length + 1, device=ix.q.device)
        visible = (positions // ratio).clamp(max=n).to(torch.int32)
        table = torch.arange(batch * pages, dtype=torch.int32, device=ix.q.device).view(
            batch, 1, -1
        )
        indices = kernels.lightning_indexer(
            ix.q.to(dtype).reshape(batch * length, 1, heads, dim),
            keys.view(batch * pages, page, 1, dim),
            ix.weights.to(dtype).reshape(batch * length, 1, heads),
            actual_seq_lengths_key=visible.repeat(batch),
            block_table=table.expand(batch, length, pages).reshape(batch * length, pages),
            sparse_count=k,
        )
        picks = indices.view(batch, length, k).long()
        return picks.masked_fill((picks < 0) | (picks >= visible.view(1, -1, 1)), -1)


def _read_indices(
    inputs: AttentionInputs, t0: int, t1: int, n_entries: int | None, picks: torch.Tensor | None
) -> torch.Tensor:
    """Int32 [B, c, 1, K]: the keys of queries t0 .. t1 - 1 among ``[window keys, entries]``,
    the valid ones first (window slots, then entries), -1 after them."""
    q, window, start = inputs.q, inputs.window, inputs.shard.start
    batch, device = q.shape[0], q.device
    t = torch.arange(t0, t1, device=device).unsqueeze(1)
    slot = torch.arange(window, device=device).unsqueeze(0)
    keys = [(t + slot).expand(batch, -1, -1)]
    valid = [(start + t - window + 1 + slot >= 0).expand(batch, -1, -1)]
    if n_entries is not None:
        offset = window - 1 + q.shape[1]
        if picks is not None:
            chunk = picks[:, t0:t1]
            keys.append(offset + chunk.clamp_min(0))
            valid.append(chunk >= 0)
        else:
            seen = min(visible_count(start + t1 - 1, inputs.ratio), n_entries)
            entry = torch.arange(seen, device=device).unsqueeze(0)
            keys.append((offset + entry).expand(batch, t1 - t0, -1))
            valid.append(((entry + 1) * inputs.ratio <= start + t + 1).expand(batch, -1, -1))
    index, ok = torch.cat(keys, dim=-1), torch.cat(valid, dim=-1)
    order = torch.sort((~ok).to(torch.uint8), dim=-1, stable=True).indices
    index = index.gather(-1, order).masked_fill(~ok.gather(-1, order), -1)
    return index.to(torch.int32).unsqueeze(2)


def _zero_rope(x: torch.Tensor, kernels: NpuKernels) -> torch.Tensor:
    return x.new_zeros(*x.shape[:-1], kernels.rope_dim)


class _SparseAttention(torch.autograd.Function):
    """The fused softmax over each query's listed keys, then the sink (see the module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        kernels: NpuKernels,
        q: torch.Tensor,
        kv: torch.Tensor,
        sink: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_rope, kv_rope = _zero_rope(q, kernels), _zero_rope(kv, kernels)
        out, softmax_max, softmax_sum = kernels.sparse_flash_attention(
            q, kv, indices, scale, query_rope=q_rope, key_rope=kv_rope
        )
        lse = (softmax_max + softmax_sum.log()).squeeze(1)  # [B, c, H]
        gate = torch.sigmoid(lse - sink.float())
        out = (out.float() * gate.unsqueeze(-1)).to(q.dtype)
        ctx.kernels, ctx.scale = kernels, scale
        ctx.save_for_backward(q, kv, indices, out, softmax_max, softmax_sum, gate)
        ctx.mark_non_differentiable(softmax_max, softmax_sum)
        return out, softmax_max, softmax_sum

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        q, kv, indices, out, softmax_max, softmax_sum, gate = ctx.saved_tensors
        kernels: NpuKernels = ctx.kernels
        d_fused = (d_out.float() * gate.unsqueeze(-1)).to(q.dtype)
        ropes = dict(query_rope=_zero_rope(q, kernels), key_rope=_zero_rope(kv, kernels))
        d_q, d_kv = kernels.sparse_flash_attention_grad(
            q, kv, indices, d_fused, out, softmax_max, softmax_sum, ctx.scale, **ropes
        )
        d_sink = -((1 - gate) * (d_out.float() * out.float()).sum(dim=-1)).sum(dim=(0, 1))
        return None, d_q, d_kv, d_sink, None, None


class _IndexerKl(torch.autograd.Function):
    """The fused KL: its loss in the forward, its gradients of the index factors kept for the
    backward (scaled by the upstream gradient and 1 / the queries counted)."""

    @staticmethod
    def forward(
        ctx: Any,
        kernels: NpuKernels,
        index_q: torch.Tensor,
        index_keys: torch.Tensor,
        index_weights: torch.Tensor,
        q: torch.Tensor,
        entries: torch.Tensor,
        softmax_max: torch.Tensor,
        softmax_sum: torch.Tensor,
        picks: torch.Tensor,
        scale: float,
        count: torch.Tensor,
    ) -> torch.Tensor:
        dtype = q.dtype
        key = entries.unsqueeze(2).contiguous()
        d_q, d_keys, d_weights, loss = kernels.sparse_lightning_indexer_grad_kl_loss(
            q,
            key,
            index_q.to(dtype).contiguous(),
            index_keys.to(dtype).unsqueeze(2).contiguous(),
            index_weights.to(dtype).contiguous(),
            picks.to(torch.int32).unsqueeze(2).contiguous(),
            softmax_max,
            softmax_sum,
            scale,
            query_rope=_zero_rope(q, kernels),
            key_rope=_zero_rope(key, kernels),
        )
        count = count.float()
        ctx.save_for_backward(
            d_q.float() / count, d_keys.squeeze(2).float() / count, d_weights.float() / count
        )
        return loss.float().sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        d_q, d_keys, d_weights = ctx.saved_tensors
        return None, grad * d_q, grad * d_keys, grad * d_weights, *([None] * 7)
