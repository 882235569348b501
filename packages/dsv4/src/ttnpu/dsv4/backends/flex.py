"""The attention core through torch's ``flex_attention`` (CUDA, compiled by torch.compile).

One ``flex_attention`` call per layer, over the keys ``[window keys (W - 1 + L) | compressed
entries (N)]`` (K = V, one KV head shared by the H query heads: ``enable_gqa``), under a
``BlockMask`` whose ``mask_mod`` is: the query's window (``t - W + 1 <= key <= t``, not before
the sequence start) OR (entry ``s`` visible, ``s < (t + 1) // m``, AND, on sparse CSA layers,
selected by the indexer). ``create_block_mask`` (compiled) turns it into block sparsity: blocks
outside the band and the visible staircase are skipped.

**The sink.** flex returns each row's log-sum-exp ``lse`` over its keys. A sink logit ``s_h``
with a zero value adds ``exp(s_h)`` to the softmax's denominator and nothing to its numerator:
``out' = out * Z / (Z + exp(s_h)) = out * sigmoid(lse - s_h)``, with ``Z = exp(lse)``. flex's
backward takes the gradient of ``lse`` too, so the sink's and every key's gradients are exact.

**The indexer's selection as a mask.** Selection is per query (its top-k of the entries), not
per block. The mask reads each query's picks, sorted, and tests ``s`` by a binary search
(``k.bit_length() + 1`` loads): memory ``L x k`` (the picks, as the chunked backend keeps them),
nothing ``S x N``. Block sparsity is at the granularity of (128 queries x 128 keys) blocks, and
the union of 128 queries' top-k touches most entry blocks: on sparse CSA layers flex therefore
computes the scores of (nearly) every visible entry and masks the unselected ones; exact, but
its cost is that of dense compressed attention (the chunked backend gathers the k picks).

**The indexer's KL** (CSA layers) is computed per query chunk after the flex call, from its
``lse``: the attention's probability on entry ``s`` is ``exp(q_h . e_s * scale - lse_total_h)``
with ``lse_total = logaddexp(lse, s_h)``, summed over heads, under no_grad (the target); the
index scores at the entries read carry the gradient. Each chunk is recomputed in the backward.

**Wide heads.** Inductor's default forward tiles are tuned for rows of up to 256 bytes (bf16 heads
of 128); wider ones (Flash's 512-dim bf16 heads, fp32 heads of 128) need more shared memory than
a Hopper SM has (H200, fp32 heads of 128: 254,080 bytes asked, 232,448 there) and fail to compile.
For those, :func:`kernel_options` picks the forward tiles and pipeline depth to fit.

On a CPU, torch 2.14's flex_attention has no backward (``_validate_device``) and runs unfused:
the backend refuses every device but CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from . import AttentionInputs
from .indexer_loss import indexer_loss_from_lse
from .selection import select_topk

__all__ = ["flex_attention_backend", "flex_attention_core", "kernel_options"]

FlexFn = Callable[..., Any]
BlockMaskFn = Callable[..., BlockMask]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_TUNED_ROW_BYTES = 256  # Inductor's default forward tiles fit up to here (bf16 x 128)
_SHARED_MEMORY_BUDGET = 160 * 1024  # of a Hopper SM's 227 KiB: the kernel's other buffers
# (BLOCK_M, BLOCK_N), largest first; each divides the block mask's 128 x 128 blocks.
_WIDE_BLOCKS = ((64, 32), (32, 32), (32, 16), (16, 16))


def kernel_options(head_dim: int, dtype: torch.dtype) -> dict[str, int] | None:
    """Forward tiles for heads whose rows are wider than Inductor's defaults are tuned for, or
    None (the defaults). The estimate is a Q tile plus ``num_stages`` K and V tiles in flight,
    ``row * (BLOCK_M + 2 * num_stages * BLOCK_N)`` bytes, kept under a budget that leaves room
    for the rest (this estimate of the failing default is ~45 KiB under what it asked for). The
    largest tiles that fit a stage win, with up to 3 stages."""
    row = head_dim * dtype.itemsize
    if row <= _TUNED_ROW_BYTES:
        return None
    for block_m, block_n in _WIDE_BLOCKS:
        stages = (_SHARED_MEMORY_BUDGET // row - block_m) // (2 * block_n)
        if stages >= 1:
            return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_stages": min(stages, 3)}
    raise ValueError(
        f"attention_backend='flex': heads of {head_dim} x {dtype} ({row} bytes a row) do not "
        "fit one pipeline stage in shared memory; use the chunked backend"
    )


def flex_attention_backend(inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = inputs.q.device
    if device.type != "cuda":
        raise ValueError(f"attention_backend='flex' needs a CUDA device; got {device.type}")
    flex, block_mask = _compiled()
    return flex_attention_core(inputs, flex=flex, block_mask=block_mask)


@functools.cache
def _compiled() -> tuple[FlexFn, BlockMaskFn]:
    return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask)


def flex_attention_core(
    inputs: AttentionInputs,
    *,
    flex: FlexFn = flex_attention,
    block_mask: BlockMaskFn = create_block_mask,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backend on any device flex accepts, with the given (compiled or eager) ``flex`` and
    ``block_mask`` builders."""
    q, shard, ix, entries = inputs.q, inputs.shard, inputs.indexer, inputs.entries
    batch, length = q.shape[:2]
    if entries is not None and entries.shape[1] == 0:
        entries = None  # a sequence shorter than one block
    picks = None
    if entries is not None and ix is not None and ix.sparse:
        picks = select_topk(ix, shard.start, inputs.ratio, inputs.select_logits)
        if picks.shape[-1] == 0:
            entries = picks = None
    kv = inputs.keys if entries is None else torch.cat((inputs.keys, entries), dim=1)
    mask_mod = _mask_mod(inputs, length, None if entries is None else entries.shape[1], picks)
    mask = block_mask(
        mask_mod,
        batch if picks is not None else None,  # the same mask for every batch row otherwise
        None,  # and for every head
        length,
        kv.shape[1],
        device=q.device,
    )
    out, aux = flex(
        q.transpose(1, 2),
        kv.unsqueeze(1),
        kv.unsqueeze(1),
        block_mask=mask,
        scale=inputs.scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        kernel_options=kernel_options(q.shape[-1], q.dtype),
    )
    lse = aux.lse.float().transpose(1, 2)  # [B, L, H]
    sink = inputs.sink.float()
    out = out.transpose(1, 2).float() * torch.sigmoid(lse - sink).unsqueeze(-1)
    out = out.to(inputs.keys.dtype)
    if ix is None:
        return out, None
    if entries is None:
        return out, q.new_zeros((), dtype=torch.float32)
    lse_total = torch.logaddexp(lse, sink).detach()
    return out, indexer_loss_from_lse(inputs, entries, picks, lse_total)


def _mask_mod(
    inputs: AttentionInputs, length: int, n_entries: int | None, picks: torch.Tensor | None
) -> MaskMod:
    """Key ``j`` of the concatenated keys: window slot (``j < W - 1 + L``, key position
    ``start - W + 1 + j``) or entry ``j - (W - 1 + L)``."""
    window, start, ratio = inputs.window, inputs.shard.start, inputs.ratio
    first_key = window - 1 - start  # slots before it lie before the sequence start
    offset = window - 1 + length
    selected = None if picks is None else _membership(picks, n_entries or 0)

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        reads = (kv_idx >= q_idx) & (kv_idx <= q_idx + (window - 1)) & (kv_idx >= first_key)
        if n_entries is None:
            return reads
        entry = kv_idx - offset
        # s < (t + 1) // m  <=>  (s + 1) * m <= t + 1, for s, t >= 0
        visible = (entry >= 0) & ((entry + 1) * ratio <= q_idx + (start + 1))
        if selected is not None:
            visible = visible & selected(b, q_idx, entry.clamp(min=0))
        return reads | visible

    return mask_mod


def _membership(
    picks: torch.Tensor, n_entries: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``selected(b, t, s)``: whether query t of batch row b picked entry s, by a binary search
    of its picks sorted ascending (the unused ones, -1, as ``n_entries``, after every entry)."""
    k = picks.shape[-1]
    ordered = picks.masked_fill(picks < 0, n_entries).sort(dim=-1).values.to(torch.int32)
    steps = [1 << p for p in reversed(range(k.bit_length()))]

    def selected(b: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        below = torch.zeros_like(s)  # how many picks are < s
        for step in steps:
            ahead = below + step
            smaller = ordered[b, t, (ahead - 1).clamp(max=k - 1)] < s
            below = torch.where((ahead <= k) & smaller, ahead, below)
        return (below < k) & (ordered[b, t, below.clamp(max=k - 1)] == s)

    return selected
