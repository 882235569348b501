"""Attention backends: interchangeable implementations of one function, DeepSeek-V4's attention
core (after the projections, before the output projection).

Each query attends, in one softmax, to its sliding window of keys, to compressed entries (every
visible one on HCA layers and in the indexer's dense warm-up; the lightning indexer's top-k on
CSA layers) and to a learned per-head sink logit with a zero value. On CSA layers the backend
also returns the indexer's distillation loss against that softmax's mass on the entries.

- ``reference``: dense and masked, every query against every entry (``[B, S, H, S/m]``); for
  parity tests only.
- ``chunked`` (default, any device): queries in chunks, each recomputed in the backward; CSA
  gathers only the selected entries, the indexer selects its top-k over key blocks. Nothing
  grows with ``S x S/m``.
- ``flex``: torch's ``flex_attention`` (CUDA).
- ``npu``: Ascend's fused sparse-attention and lightning-indexer operators.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

import torch

from ttnpu.dsv4.config import AttentionBackend
from ttnpu.dsv4.context_parallel import SequenceShard
from ttnpu.dsv4.norms import rms_normalize
from ttnpu.dsv4.rope import RopeTable, apply_rope

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionInputs",
    "IndexerInputs",
    "attend",
]

BACKENDS: tuple[str, ...] = get_args(AttentionBackend)


@dataclass(frozen=True)
class IndexerInputs:
    """The lightning indexer's score ``I[t, s] = sum_h weights[t, h] * relu(q[t, h] . keys[s])``
    of this slice's queries over every entry of the sequence, as its factors (fp32, detached
    from the main model; they carry the indexer's own gradient)."""

    q: torch.Tensor  # [B, L, IH, ID], rotated
    keys: torch.Tensor  # [B, N, ID], rotated, gathered over CP ranks
    weights: torch.Tensor  # [B, L, IH], the softmax scale folded in
    topk: int
    sparse: bool  # top-k reads; False in the dense warm-up (every visible entry, KL over all)


@dataclass(frozen=True)
class AttentionInputs:
    """One layer's attention of this rank's slice of the sequence."""

    q: torch.Tensor  # [B, L, H, D] normalised and rotated queries (see q_rope)
    keys: torch.Tensor  # [B, W - 1 + L, D] rotated kv (K = V): the window halo, then the slice
    window: int  # W: query t reads keys t - W + 1 .. t
    sink: torch.Tensor  # [H] sink logits
    scale: float  # softmax scale
    shard: SequenceShard  # where the slice lies (its first query is at position shard.start)
    entries: torch.Tensor | None = None  # [B, N, D] every compressed entry (None: window only)
    ratio: int = 0  # m: entry s is visible to query t iff s < (t + 1) // m
    indexer: IndexerInputs | None = None  # CSA layers
    chunk_logits: int = 1 << 26  # the chunked backend's budget of logits per chunk
    select_logits: int = 1 << 28  # the indexer's top-k selection budget of scores per step
    # Set: q is still to be normalised per head (RMS, q_eps) and rotated by this table (rows
    # = the slice's positions). The chunked backend does it inside each recomputed chunk, so
    # the backward keeps one copy of q instead of two; the others do it first (``attend``).
    q_rope: RopeTable | None = None
    q_eps: float = 0.0

    def queries(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The normalised, rotated queries of the slice's rows ``start .. stop - 1``."""
        q = self.q[:, start:stop]
        if self.q_rope is None:
            return q
        table = self.q_rope.rows(start, q.shape[1] + start)
        return apply_rope(rms_normalize(q, self.q_eps), table)


def attend(
    backend: AttentionBackend, inputs: AttentionInputs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Output [B, L, H, D] in the keys' dtype, this rank's share of the indexer loss on CSA
    layers or None)."""
    if backend != "chunked" and inputs.q_rope is not None:
        inputs = replace(inputs, q=inputs.queries(), q_rope=None)
    if backend == "reference":
        from .reference import reference_attention

        return reference_attention(inputs)
    if backend == "chunked":
        from .chunked import chunked_attention

        return chunked_attention(inputs)
    if backend == "flex":
        from .flex import flex_attention_backend

        return flex_attention_backend(inputs)
    if backend == "npu":
        from .npu import npu_attention

        return npu_attention(inputs)
    raise ValueError(f"unknown attention_backend {backend!r}; expected one of {list(BACKENDS)}")
