"""Context-parallel memory and communication model of ttnpu-dsv4 (DeepSeek-V4), with its check.

``predict`` gives, for a config, a sequence length and a CP degree, the bytes autograd keeps from
the forward to the backward on one rank (the activation memory that context parallelism divides),
term by term, and the bytes each rank sends per forward + backward for CP. It is a closed-form
model of THIS implementation, derived by reading which tensors each op of ``ttnpu.dsv4`` saves
(the mHC streams, mixes and Sinkhorn steps, the norms' inputs and rsqrt, the T x top-k
grouped-matmul rows, ...): no term is fitted to a measurement. It covers both attention backends
(``config.attention_backend``): ``reference`` keeps the dense masked softmax over all compressed
entries and the indexer's [L, heads, N] scores; ``chunked`` recomputes each query chunk in the
backward (``torch.utils.checkpoint``), so it keeps only the chunks' inputs (q, the padded keys,
the entries, the indexer's top-k picks and factors). And activation checkpointing (``ac``), the
torchtitan way: ``full`` wraps every block (main layers and the MTP block) in a non-reentrant
checkpoint, ``selective`` every ``ac_every``-th one (blocks counted from 1: layers, then MTP); a
wrapped block keeps only its inputs, and its backward recomputes it (``recompute_bytes``: what
the largest such block saves besides its inputs, a transient that is not saved for the
backward).

``measure`` runs the debug model's ``loss`` on CPU in gloo processes, one per CP rank
(subprocesses of this script), for each attention backend and AC mode, with fp32 weights and
then bf16 weights (as FSDP's ``param_dtype`` gives the forward). Per rank it counts the distinct
storages (by data_ptr, whole ``nbytes``; parameters and buffers excluded) of the tensors that
``saved_tensors_hooks`` saw being saved and that the loss's graph still holds when the forward
ends: exactly the memory that waits for the backward. A non-reentrant checkpoint saves its
tensor inputs through these hooks (and hides what runs inside it), so under AC and in the
chunked backend the hooks see the checkpoints' inputs; the few non-tensor inputs a checkpoint
keeps (the RoPE tables inside a block's ``RopeTable``, the CPU RNG state, ~5 KiB per
checkpoint) are not counted, here or in the model. It also reports each rank's peak of live
tensor bytes over the forward + backward beyond the weights and their gradient buffers (the
profiler's CPU allocation events), which adds transients (the recomputed block, a chunk's
scores, gradients in flight).

Run:
    uv run python tools/cp_memory_model.py --flavor flash --seq-len 1048576 --cp 128 --ac full
    uv run python tools/cp_memory_model.py --check   # debug model, 501 tokens, CP 1/2/4, every
    # attention backend x AC mode, fp32 and bf16: ~2.5 min on 2 idle cores (--no-peak: half)

Each prints one JSON line. Bytes are per rank: the busiest one (memory and communication each).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.context_parallel import compressor_halo, split

__all__ = [
    "AC_MODES",
    "ATTENTIONS",
    "Communication",
    "Prediction",
    "activation_checkpointing",
    "cast_weights",
    "check",
    "checkpointed_blocks",
    "fsdp_bytes",
    "measure",
    "predict",
    "saved_for_backward",
]

FP32 = 4
INT64 = 8
GIB = 2**30
CHECK_SEQ_LEN = 501  # a multiple of none of the block sizes (4, 16), the window (32) or CP 2/4
CHECK_DEGREES = (1, 2, 4)
# The chunked backend's budget in the check, the indexer's selection budget too: 23-query chunks
# on CSA layers (whose budget counts the gathered entries), 256 on HCA, so the ranks run several
# chunks and the indexer's selection several query chunks and key blocks.
CHECK_CHUNK_LOGITS = 1 << 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # measured in this order
ATTENTIONS = ("reference", "chunked")  # the backends the model covers
AC_MODES = ("none", "full", "selective")  # selective: every ac_every-th block (layer-selective)

# The terms of the bytes kept for the backward, in the order printed.
TERMS = (
    "embedding",  # token ids, the embedding output (the first block's input)
    "mhc_streams",  # the n residual streams entering every mHC site and hc_head
    "mhc_mixing",  # pre/post/comb mixes and gates, the Sinkhorn softmax
    "attention_qkv",  # attn_norm, q/kv low-rank projections, q/kv norms, rotated q, window keys
    "window_probs",  # reference: softmax probabilities over the W window keys and the sink
    "entry_probs",  # reference: ... over ALL N compressed entries [L, H, N] (masked, dense)
    "compressed_entries",  # compressor inputs, gated pooling, norm, the gathered entries
    "indexer",  # its compressor, q, weights, gathered keys; reference: scores [L, IH, N], KL;
    # chunked: the top-k picks
    "attention_output",  # grouped output projection and the sub-layer output
    "rope_tables",  # cos/sin tables (per forward, per compressor, inverse per layer)
    "moe_router",  # ffn_norm, gate scores, combine weights, balance loss
    "moe_routed",  # top-k rows' order, token ids and weights (the experts recompute the rest)
    "moe_shared",  # the MoE output (routed + shared) that hc_post keeps
    "head",  # final hc_head and norm, fp32 log-probabilities [L, vocab], labels
    "mtp",  # the MTP block: projections, one sliding-window block, its hc_head, norm and head
    "weight_casts",  # bf16 weights only: their fp32 copies that the fp32 islands keep (routers,
    # attention compressors): per die whatever the CP degree
)


@dataclass
class Communication:
    """Bytes one rank sends per forward + backward: halos in full, collectives as a ring
    algorithm sends them (the first and last ranks send their halos one way only)."""

    window_halo: float = 0.0  # (W - 1) kv rows to the next rank, the gradient back
    compressor_halo: float = 0.0  # x rows before the slice, per compressor (indexer's: no grad)
    entries_all_gather: float = 0.0  # compressed entries and indexer keys, forward
    entries_reduce_scatter: float = 0.0  # their gradients, backward
    statistics_all_reduce: float = 0.0  # balance-loss expert counts, indexer query counts
    recompute: float = 0.0  # the forward sends of checkpointed blocks, again in their recompute
    forward: float = field(default=0.0, repr=False)  # of the above: what the forward sends

    @property
    def total(self) -> float:
        return (
            self.window_halo
            + self.compressor_halo
            + self.entries_all_gather
            + self.entries_reduce_scatter
            + self.statistics_all_reduce
            + self.recompute
        )

    def send(self, kind: str, forward: float, backward: float = 0.0) -> None:
        setattr(self, kind, getattr(self, kind) + forward + backward)
        self.forward += forward

    def add(self, other: Communication, *, recomputed: bool) -> None:
        """``other``'s bytes (a block's); ``recomputed``: its forward runs again in the backward."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        if recomputed:
            self.recompute += other.forward


@dataclass
class Prediction:
    """Bytes saved for the backward per term and CP communication bytes, for one rank."""

    rank: int
    tokens: int  # this rank's slice length
    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    communication: Communication = field(default_factory=Communication)
    # The largest checkpointed block's own saved bytes but its inputs: what its recompute adds,
    # one block at a time, during the backward (not saved for the backward; 0 without AC).
    recompute_bytes: float = 0.0

    @property
    def saved_bytes(self) -> float:
        """Everything autograd keeps from the forward to the backward (the sum of the terms)."""
        return sum(self.terms.values())


@dataclass(frozen=True)
class _Slice:
    """What the formulas need of one rank's slice of a batch of sequences."""

    batch: int
    start: int
    stop: int
    seq_len: int
    cp: int
    rank: int

    @property
    def tokens(self) -> int:  # B * L: rows of every per-token activation
        return self.batch * (self.stop - self.start)

    @property
    def length(self) -> int:  # L: rows of the tensors that are the same for every sequence
        return self.stop - self.start

    def halo(self, nbytes: float, *, backward: bool) -> tuple[float, float]:
        """(Forward, backward) bytes of a halo of ``nbytes``: sent to the next rank (all but the
        last), and with ``backward`` its gradient to the previous one (all but the first)."""
        return int(self.rank < self.cp - 1) * nbytes, int(backward and self.rank > 0) * nbytes


_split = lru_cache(split)


def _norm(rows: int, width: int, input_bytes: int) -> float:
    """RMSNorm / rms_normalize on [rows, width] (one autograd node): it saves its input as given
    and the [rows, 1] fp32 rsqrt. Its output belongs to the consumer that saves it."""
    return input_bytes * rows * width + FP32 * rows


def _terms() -> dict[str, float]:
    return dict.fromkeys(TERMS, 0.0)


class _Model:
    """The closed-form terms, one method per part of the code they come from."""

    def __init__(self, config: DeepSeekV4Config, act: int, ep: int = 1) -> None:
        self.c, self.a, self.ep = config, act, ep
        self.upcast = FP32 if act != FP32 else 0  # bytes of an extra fp32 copy (x.float())
        self.chunked = config.attention_backend == "chunked"

    # mHC ---------------------------------------------------------------------------------------
    def site_mixing(self, t: int) -> float:
        """hc_pre + hc_post of one site, without the streams and the sub-layer output: the
        collapse saves the per-row scales, rsqrt, mixes, gates, pre and the Sinkhorn softmax
        (its normalisations are recomputed); hc_post saves post and comb."""
        n = self.c.hc_mult
        rows = (2 + n) * n
        collapse = FP32 * rows + FP32 * t + FP32 * rows * t  # scales, rsqrt, mixes
        collapse += FP32 * t * (2 * n + n + n * n)  # gates, pre, softmax
        return collapse + FP32 * t * (n + n * n)  # post, comb

    def streams(self, t: int) -> float:
        """One [T, n, dim] stream tensor (a site saves it as given)."""
        return self.a * t * self.c.hc_mult * self.c.dim

    def hc_head_mixing(self, t: int) -> float:
        """An hc_head collapse (n mix rows, no Sinkhorn), without its input streams: rsqrt,
        mixes, gates, pre (and, with bf16 weights, its scale's fp32 copy)."""
        n = self.c.hc_mult
        return FP32 * t + 3 * FP32 * t * n + (FP32 if self.a != FP32 else 0)

    # Attention ---------------------------------------------------------------------------------
    def attention(
        self, s: _Slice, ratio: int, terms: dict[str, float], comm: Communication
    ) -> None:
        c, a, t, ln = self.c, self.a, s.tokens, s.length
        h, d, w = c.n_heads, c.head_dim, c.window_size
        qkv = FP32 * t + a * t * c.dim  # attn_norm (fused into hc_pre: its rsqrt), its output
        qkv += _norm(t, c.q_lora_rank, a) + a * t * c.q_lora_rank  # q_norm, qr (wq_b's input)
        if self.chunked:  # wq_b's output: the chunks normalise and rotate it when recomputed
            qkv += a * t * h * d
        else:  # per-head rms_normalize of wq_b's output, and the rotated q
            qkv += _norm(t * h, d, a) + a * t * h * d
        qkv += _norm(t, d, a)  # kv_norm (its output is only rotated: not saved)
        qkv += self.window_keys(s)
        terms["attention_qkv"] += qkv
        terms["rope_tables"] += FP32 * ln * c.rope_head_dim // 2  # -sin of the inverse rotation
        entries = s.seq_len // ratio if ratio else 0
        if not self.chunked:
            # fp32 probabilities (and off fp32 their cast back for the value matmuls), ~mask
            probs = FP32 + (a if a != FP32 else 0)
            terms["window_probs"] += probs * t * h * (w + 1) + ln * w
            if ratio:  # ~reads (bool) is per sequence on CSA (the top-k's), shared on HCA
                mask = (s.batch if c.is_csa(ratio) else 1) * ln * entries
                terms["entry_probs"] += probs * t * h * entries + mask
        if ratio:
            csa = c.is_csa(ratio)
            own = self.compressor(s, ratio, d, terms, comm, overlap=csa, indexer=False)
            terms["compressed_entries"] += own
            if csa:
                self.indexer(s, ratio, terms, comm)
        out = a * t * h * d + a * t * c.o_groups * c.o_lora_rank  # grouped copy, wo_b input
        terms["attention_output"] += out + a * t * c.dim  # + the output (hc_post saves it)
        # Window halo: W - 1 kv rows to the next rank, their gradient back to the previous one.
        comm.send("window_halo", *s.halo(a * s.batch * (w - 1) * d, backward=True))

    def window_keys(self, s: _Slice) -> float:
        """The padded window keys (halo + slice). Chunked: the chunks' inputs are slices of
        them. Reference: an unfold view the two window matmuls save; with more than one
        sequence the view cannot be folded into their batch, so each saves a [B * L, W, D]
        copy instead."""
        c = self.c
        if self.chunked or s.batch == 1:
            return self.a * s.batch * (s.length + c.window_size - 1) * c.head_dim
        return 2 * self.a * s.tokens * c.window_size * c.head_dim

    def compressor(
        self,
        s: _Slice,
        ratio: int,
        width: int,
        terms: dict[str, float],
        comm: Communication,
        *,
        overlap: bool,
        indexer: bool,
    ) -> float:
        """Bytes of one compressor on this rank (its rope tables go to ``terms`` directly).
        ``indexer``: the indexer's, whose input is detached (its halo has no backward) and whose
        keys are saved in fp32."""
        c, a, o = self.c, self.a, int(overlap)
        begin = max(s.start // ratio - o, 0) * ratio
        rows = s.stop - begin  # the slice and the halo before it
        computed = rows // ratio  # blocks compressed here (the kept ones, plus the halo's)
        n_all = s.seq_len // ratio
        size: float
        if self.a != FP32:  # one fp32 copy of the complete blocks, both projections read it
            size = FP32 * s.batch * computed * ratio * c.dim
        elif s.batch == 1 or rows % ratio == 0:  # the halo + slice cat itself, whole
            size = FP32 * s.batch * rows * c.dim
        else:  # its complete blocks: a non-contiguous slice each projection copies
            size = 2 * FP32 * s.batch * computed * ratio * c.dim
        size += 2 * FP32 * s.batch * computed * (1 + o) * ratio * width  # kv, softmax(gate)
        size += _norm(s.batch * computed, width, FP32)  # on the fp32 pooled entries
        # The attention's entries are saved as they come (activation dtype); the indexer's keys
        # are cast to fp32 before they are saved.
        size += (FP32 if indexer else a) * s.batch * n_all * width
        if s.cp > 1:
            size += INT64 * n_all  # the index that drops the all-gather's padding
        terms["rope_tables"] += 2 * FP32 * rows * c.rope_head_dim // 2  # span table cos, sin
        if s.cp > 1:
            bounds = _split(s.seq_len, s.cp)
            halo = max(compressor_halo(st, ratio, overlap) for st, _ in bounds)
            comm.send("compressor_halo", *s.halo(a * s.batch * halo * c.dim, backward=not indexer))
            width_max = max(b // ratio - st // ratio for st, b in bounds)
            ring = (s.cp - 1) * a * s.batch * width_max * width  # padded all_gather_single
            comm.send("entries_all_gather", ring)
            comm.send("entries_reduce_scatter", 0.0, ring)
        return size

    def indexer(self, s: _Slice, ratio: int, terms: dict[str, float], comm: Communication) -> None:
        c, t, ln = self.c, s.tokens, s.length
        ih, n_all = c.index_n_heads, s.seq_len // ratio
        size = self.compressor(s, ratio, c.index_head_dim, terms, comm, overlap=True, indexer=True)
        size += self.upcast * t * c.dim  # weights_proj's fp32 input (off fp32 only)
        size += FP32 * t * ih * c.index_head_dim + FP32 * t * ih  # rotated q, head weights (fp32)
        if self.chunked:  # the top-k picks (int64, selected under no_grad), the chunks' input
            size += INT64 * t * min(c.index_topk, n_all) if n_all else 0
        else:
            size += FP32 * t * ih * n_all  # relu(q . K) [L, IH, N]
            size += ln * n_all  # ~visible (the top-k's own scores are selected under no_grad)
            size += s.batch * ln * n_all + 2 * FP32 * t * n_all + t  # KL: ~reads, log_softmax,
            # target, rows
        terms["indexer"] += size
        if s.cp > 1:  # the query count of the KL mean (int64 scalar)
            comm.send("statistics_all_reduce", 2 * (s.cp - 1) / s.cp * INT64)

    # MoE ---------------------------------------------------------------------------------------
    def moe(
        self, s: _Slice, hash_routed: bool, terms: dict[str, float], comm: Communication
    ) -> None:
        c, a, t = self.c, self.a, s.tokens
        e, k, dim = c.n_routed_experts, c.n_activated_experts, c.dim
        router = FP32 * t  # ffn_norm (fused into hc_pre: its rsqrt; its output is below)
        router += a * t * dim + self.upcast * t * dim  # its output, the gate's fp32 copy of it
        router += 2 * FP32 * t * e  # softplus input, sqrt output
        router += INT64 * t * k + FP32 * t * k + FP32 * t  # indices, picked scores, their sum
        if not hash_routed:  # balance loss: score sums and the count vector
            router += FP32 * t + FP32 * s.batch * e
            if s.cp > 1:
                comm.send("statistics_all_reduce", 2 * (s.cp - 1) / s.cp * FP32 * s.batch * e)
        terms["moe_router"] += router
        # The routed and the shared experts are one autograd node each that saves its input
        # (ffn_norm's output, counted) and recomputes the rest in the backward; the routed one
        # also keeps the rows' order (the index of the weights' gather), token ids, combine
        # weights and group offsets.
        rows = t * k
        terms["moe_routed"] += 2 * INT64 * rows + FP32 * rows + 4 * e
        if self.ep > 1:  # the dispatch's rows: the local experts' input (received), and the
            # returned rows the combine weights multiply
            terms["moe_routed"] += 2 * a * rows * dim

    # The whole model ---------------------------------------------------------------------------
    def block(
        self, s: _Slice, ratio: int, hash_routed: bool, *, first: bool
    ) -> tuple[dict[str, float], Communication]:
        """One Block (two mHC sites around attention and MoE): what it saves, its input
        included (``first``: the embedding output, counted with the embedding), and what it
        sends."""
        terms, comm = _terms(), Communication()
        t = s.tokens
        terms["mhc_streams"] += (0 if first else self.streams(t)) + self.streams(t)  # in, mid
        terms["mhc_mixing"] += 2 * self.site_mixing(t)
        self.attention(s, ratio, terms, comm)
        self.moe(s, hash_routed, terms, comm)
        terms["weight_casts"] += self.weight_casts(ratio)
        terms["moe_shared"] += self.a * t * self.c.dim  # the MoE output (hc_post saves it)
        return terms, comm

    def weight_casts(self, ratio: int) -> float:
        """fp32 copies of a block's bf16 weights that ``.float()`` makes and autograd keeps:
        the router, the attention compressor's projections (not the indexer's: its inputs are
        detached, so no input gradient needs its weights)."""
        if self.a == FP32:
            return 0
        c = self.c
        params = c.n_routed_experts * c.dim
        if ratio:
            csa = c.is_csa(ratio)
            params += 2 * (1 + csa) * c.head_dim * c.dim  # wkv, wgate
        return FP32 * params

    def head(self, s: _Slice) -> float:
        """hc_head mixing, final norm and its output, fp32 log-probabilities, the labels."""
        t = s.tokens
        return (
            self.hc_head_mixing(t)
            + FP32 * t  # the final norm, fused into hc_head: its rsqrt
            + self.a * t * self.c.dim
            + FP32 * t * self.c.vocab_size
            + INT64 * s.batch * s.seq_len
        )

    def mtp(self, s: _Slice) -> tuple[dict[str, float], float, Communication]:
        """The MTP block's ``predict`` (everything but the shared embedding and head): what it
        saves, its inputs that stay when it is checkpointed, and what it sends."""
        c, a, t = self.c, self.a, s.tokens
        rows = t * c.hc_mult  # hnorm normalises each stream of the main body's output
        own = _norm(t, c.dim, a) + a * t * c.dim  # enorm (input: the next-token embedding), e_proj
        own += FP32 * rows + a * rows * c.dim  # hnorm (its input is the body's output: counted),
        # its output (h_proj's input)
        own += 2 * FP32 * s.length * c.rope_head_dim // 2  # its own main cos, sin
        terms, comm = self.block(s, 0, False, first=False)
        terms["mhc_streams"] += self.streams(t)  # the block's output, read by its hc_head
        terms["mhc_mixing"] += self.hc_head_mixing(t)
        own += FP32 * t  # its final norm's rsqrt (fused into its hc_head; the output is the
        # head's input, outside)
        terms["mtp"] += own
        return terms, a * t * c.dim, comm  # the next-token embedding is its only new input


def checkpointed_blocks(n_blocks: int, ac: str, every: int = 2) -> set[int]:
    """Which blocks (main layers, then the MTP block, from 0) activation checkpointing wraps:
    all (``full``), every ``every``-th counted from 1 (``selective``: torchtitan's layer-
    selective AC), none."""
    if ac == "op":
        raise ValueError("per-op selective AC is not modelled (use none, full or selective)")
    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {list(AC_MODES)}, got {ac!r}")
    if every < 1:
        raise ValueError(f"ac_every must be >= 1, got {every}")
    if ac == "full":
        return set(range(n_blocks))
    if ac == "selective":
        return {i for i in range(n_blocks) if (i + 1) % every == 0}
    return set()


def predict(
    config: DeepSeekV4Config,
    seq_len: int,
    cp: int,
    batch: int = 1,
    activation_bytes: int = 2,
    rank: int | None = None,
    *,
    ac: str = "none",
    ac_every: int = 2,
    ep: int = 1,
) -> Prediction:
    """The bytes autograd keeps on one CP rank from one ``loss`` forward of ``batch`` sequences
    of ``seq_len`` tokens to its backward, and the CP bytes the rank sends per forward +
    backward, for ``config.attention_backend`` (reference or chunked) and activation
    checkpointing ``ac`` (see :func:`checkpointed_blocks`).

    ``activation_bytes``: 2 for bf16 activations (mixed precision), 4 for fp32; the fp32 islands
    of the code (softmax, norms, compressors, indexer, losses) are fp32 either way. ``rank``:
    default the busiest one, the one that keeps the most (the first of them): rank 0 holds the
    longest slice, the others also the compressors' halos. ``ep``: the expert-parallel degree
    (its all-to-all dispatch keeps the routed rows; the counts assume balanced routing)."""
    if activation_bytes not in (2, 4):
        raise ValueError(f"activation_bytes must be 2 (bf16) or 4 (fp32), got {activation_bytes}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if config.attention_backend not in ATTENTIONS:
        raise ValueError(
            f"the model covers the attention backends {list(ATTENTIONS)}, "
            f"got attention_backend={config.attention_backend!r}"
        )
    if config.indexer_stage != "sparse":
        raise ValueError(
            "the model covers the sparse indexer stage; in the dense warm-up only the indexers' "
            f"graph is kept (indexer_stage={config.indexer_stage!r})"
        )
    c = config
    mtp_on = bool(c.n_mtp_layers) and seq_len > 1
    wrapped = checkpointed_blocks(c.n_layers + int(mtp_on), ac, ac_every)
    bounds = split(seq_len, cp)
    if rank is None:
        ranks = [
            _predict(c, _Slice(batch, *b, seq_len, cp, r), activation_bytes, wrapped, ep)
            for r, b in enumerate(bounds)
        ]
        return max(ranks, key=lambda p: p.saved_bytes)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}")
    bound = _Slice(batch, *bounds[rank], seq_len, cp, rank)
    return _predict(c, bound, activation_bytes, wrapped, ep)


def _predict(
    c: DeepSeekV4Config, s: _Slice, activation_bytes: int, wrapped: set[int], ep: int = 1
) -> Prediction:
    """:func:`predict` for one rank's slice ``s``, the blocks ``wrapped`` checkpointed."""
    batch, seq_len, start, stop = s.batch, s.seq_len, s.start, s.stop
    rank = s.rank
    mtp_on = bool(c.n_mtp_layers) and seq_len > 1
    model = _Model(c, activation_bytes, ep)
    out = Prediction(rank, stop - start)
    terms, comm = out.terms, out.communication
    t, a = s.tokens, activation_bytes
    table = 2 * FP32 * s.length * c.rope_head_dim // 2  # one cos, sin pair
    terms["embedding"] += INT64 * batch * seq_len  # the token ids (a slice of the whole)
    if c.n_layers:
        terms["embedding"] += a * t * c.dim  # the output the first block's streams expand
    # The main and compress tables are saved by the blocks that use them (inside a
    # checkpointed block they are a non-tensor input: not saved through the hooks).
    rope_users = {r > 0 for i, r in enumerate(c.compress_ratios) if i not in wrapped}
    terms["rope_tables"] += table * len(rope_users)
    for layer, ratio in enumerate(c.compress_ratios):
        block, sent = model.block(s, ratio, c.is_hash_layer(layer), first=layer == 0)
        comm.add(sent, recomputed=layer in wrapped)
        if layer in wrapped:  # only its input streams (layer 0: the embedding output)
            kept = 0 if layer == 0 else model.streams(t)
            terms["mhc_streams"] += kept
            out.recompute_bytes = max(out.recompute_bytes, sum(block.values()) - kept)
        else:
            for k, v in block.items():
                terms[k] += v
    terms["mhc_streams"] += model.streams(t)  # the last block's output, read by hc_head
    terms["head"] += model.head(s)
    if mtp_on:
        block, kept_input, sent = model.mtp(s)
        # Outside predict: the next-token ids (clamped), the normalised hidden state (the
        # shared head's input), fp32 log-probabilities, the shifted labels.
        terms["mtp"] += INT64 * t + a * t * c.dim + FP32 * t * c.vocab_size
        terms["mtp"] += INT64 * batch * seq_len
        comm.add(sent, recomputed=c.n_layers in wrapped)
        if c.n_layers in wrapped:
            terms["mtp"] += kept_input
            out.recompute_bytes = max(out.recompute_bytes, sum(block.values()) - kept_input)
        else:
            terms["weight_casts"] += block.pop("weight_casts")
            terms["mtp"] += sum(block.values())
    return out


def _as_dict(p: Prediction, busiest: Prediction) -> dict[str, Any]:
    """``p``'s memory; ``busiest``'s communication (the rank that sends the most)."""
    comm = busiest.communication
    return {
        "rank": p.rank,
        "tokens": p.tokens,
        "saved_gib": p.saved_bytes / GIB,
        "recompute_gib": p.recompute_bytes / GIB,
        "terms_gib": {k: v / GIB for k, v in p.terms.items()},
        "comm_rank": busiest.rank,
        "comm_bytes_per_step": {
            "window_halo": comm.window_halo,
            "compressor_halo": comm.compressor_halo,
            "entries_all_gather": comm.entries_all_gather,
            "entries_reduce_scatter": comm.entries_reduce_scatter,
            "statistics_all_reduce": comm.statistics_all_reduce,
            "recompute": comm.recompute,
            "total": comm.total,
        },
    }


def fsdp_bytes(config: DeepSeekV4Config, shards: int, param_bytes: int = 2) -> float:
    """Bytes one rank sends per step for FSDP over ``shards`` = dp x cp ranks (every parameter
    sharded; no expert parallelism): the parameters all-gathered in the forward and again in the
    backward (``reshard_after_forward``) at ``param_bytes``, the fp32 gradients reduce-scattered."""
    with torch.device("meta"):
        params = sum(p.numel() for p in DeepSeekV4(config).parameters())
    return (shards - 1) / shards * params * (2 * param_bytes + FP32)


# Measurement ---------------------------------------------------------------------------------


class _Saved:
    """What the pack hook stores: it lives exactly as long as autograd keeps the tensor."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def saved_for_backward(
    model: DeepSeekV4, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(The loss, the bytes autograd keeps for its backward): the distinct storages (by
    data_ptr, whole ``nbytes``) of the tensors saved during the forward that the loss's graph
    still holds at its end; parameters and buffers excluded. Tensors saved by branches that do
    not reach the loss (the indexer's top-k) are freed with them and not counted."""
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    packed: list[weakref.ref[_Saved]] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        packed.append(weakref.ref(saved))
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        loss = model.loss(tokens, labels)
    storages: dict[int, int] = {}
    for ref in packed:
        saved = ref()
        if saved is not None:
            storage = saved.tensor.untyped_storage()
            if storage.data_ptr() not in excluded:
                storages[storage.data_ptr()] = storage.nbytes()
    return loss, sum(storages.values())


def _measure_step(
    model: DeepSeekV4, tokens: torch.Tensor, labels: torch.Tensor, world: int, peak: bool = True
) -> dict[str, float]:
    """One forward + backward: the loss, the bytes saved for the backward, with ``peak`` the
    peak of live CPU tensor bytes over the step relative to what was live before it (the
    running sum of the profiler's allocation (+) and free (-) events; the profiler doubles the
    step's time), and the bytes sent (:class:`_SentBytes`). The parameters' gradient buffers
    exist (zeroed) before the step, as in training after the first step, so the peak is the
    step's own: saved activations, recomputed blocks and chunks, temporaries."""
    from torch.profiler import ProfilerActivity, profile

    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param) if param.grad is None else param.grad.zero_()
    memory = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    comm = _SentBytes(world)
    with memory if peak else nullcontext() as prof, comm if world > 1 else nullcontext():
        loss, saved = saved_for_backward(model, tokens, labels)
        loss.backward()
    most = live = 0
    if prof is not None:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            most = max(most, live)
    return {"loss": loss.item(), "saved_bytes": saved, "peak_live_bytes": most, "sent": comm.sent}


class _SentBytes(TorchDispatchMode):
    """Counts the bytes this rank hands to the c10d ops it issues: point-to-point sends in full,
    collectives as a ring algorithm sends them (all-gather (w - 1) x input, reduce-scatter
    (w - 1) / w x input, all-reduce 2 (w - 1) / w x input), the convention of
    :class:`Communication`."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.sent = world, 0.0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name, w = func._schema.name, self.world
        if name == "c10d::send":
            self.sent += sum(t.nbytes for t in args[0])
        elif name == "_c10d_functional::all_gather_into_tensor":
            self.sent += (w - 1) * args[0].nbytes
        elif name == "_c10d_functional::reduce_scatter_tensor":
            self.sent += (w - 1) / w * args[0].nbytes
        elif name == "c10d::allreduce_":
            self.sent += 2 * (w - 1) / w * sum(t.nbytes for t in args[0])
        elif name.startswith(("c10d::", "_c10d_functional::")) and name not in _PASSIVE_OPS:
            raise RuntimeError(f"communication op {name} is not modelled")
        return func(*args, **(kwargs or {}))


_PASSIVE_OPS = {  # c10d ops that send nothing themselves
    "c10d::recv_",
    "_c10d_functional::wait_tensor",
    "_c10d_functional::_wrap_tensor_autograd",
}


def cast_weights(model: DeepSeekV4, dtype: torch.dtype) -> None:
    """Every parameter (the fp32 ones too) in ``dtype``, buffers unchanged: what FSDP's
    ``MixedPrecisionPolicy(param_dtype=dtype)`` gives the forward."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().to(dtype)))


@contextmanager
def activation_checkpointing(model: DeepSeekV4, ac: str, every: int = 2) -> Iterator[None]:
    """Within: the blocks :func:`checkpointed_blocks` names run under a non-reentrant
    checkpoint, as torchtitan's full AC applies it (``checkpoint_wrapper``, ``early_stop``
    off). A main layer is replaced by its ``checkpoint_wrapper``. The MTP block is called
    through ``predict`` (which calls ``self.forward``), and ``checkpoint_wrapper`` forwards an
    unknown attribute to the wrapped module: a wrapped MTP block's ``predict`` would run
    unwrapped. So its ``predict`` itself is checkpointed (an instance attribute)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    layers, mtp = list(model.layers), list(model.mtp)
    wrapped = checkpointed_blocks(len(layers) + len(mtp), ac, every)
    for i in wrapped:
        if i < len(layers):
            model.layers[i] = checkpoint_wrapper(layers[i], early_stop=False)
        else:
            block = mtp[i - len(layers)]
            plain = type(block).predict.__get__(block)
            block.predict = partial(checkpoint, plain, use_reentrant=False, early_stop=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for i, layer in enumerate(layers):
            model.layers[i] = layer
        for block in mtp:
            block.__dict__.pop("predict", None)


def _worker(
    world: int,
    port: int,
    seq_len: int,
    folder: Path,
    rank: int,
    combos: list[list[Any]],
    peak: bool,
) -> None:
    """One CP rank of :func:`measure`: writes its figures per (attention, ac, every) and dtype
    to ``folder/rank{rank}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ttnpu.dsv4.parallel import apply_context_parallel

    torch.set_num_threads(1)
    mesh = None
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        mesh = init_device_mesh("cpu", (world,))
    result: dict[str, Any] = {}
    for attention in dict.fromkeys(combo[0] for combo in combos):
        torch.manual_seed(0)
        config = DeepSeekV4Config.from_flavor("debug").replace(
            attention_backend=attention,
            attention_chunk_logits=CHECK_CHUNK_LOGITS,
            index_select_logits=CHECK_CHUNK_LOGITS,
        )
        model = DeepSeekV4(config)
        if mesh is not None:
            apply_context_parallel(model, mesh)
        tokens, labels = _batch(config, seq_len)
        for name, dtype in DTYPES.items():
            cast_weights(model, dtype)
            for _, ac, every in (c for c in combos if c[0] == attention):
                with activation_checkpointing(model, ac, every):
                    figures = _measure_step(model, tokens, labels, world, peak)
                result.setdefault(_combo_name(attention, ac, every), {})[name] = figures
    (folder / f"rank{rank}").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _combo_name(attention: str, ac: str, every: int) -> str:
    return f"{attention}/{ac}" + (f"{every}" if ac == "selective" else "")


def _batch(config: DeepSeekV4Config, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator)
    return tokens, torch.roll(tokens, -1, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _combos(
    attentions: tuple[str, ...], acs: tuple[str, ...], every: int
) -> list[tuple[str, str, int]]:
    for ac in acs:
        checkpointed_blocks(1, ac, every)  # refuses a mode the model does not cover
    for attention in attentions:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")
    return [(attention, ac, every) for attention in attentions for ac in acs]


def measure(
    seq_len: int = CHECK_SEQ_LEN,
    cp: int = 1,
    attentions: tuple[str, ...] = ATTENTIONS,
    acs: tuple[str, ...] = AC_MODES,
    every: int = 2,
    peak: bool = True,
    timeout: float = 900,
) -> list[dict[str, dict[str, dict[str, float]]]]:
    """Per rank of the debug model (batch 1, CPU, chunks of ``CHECK_CHUNK_LOGITS`` logits)
    under CP degree ``cp`` (real gloo processes), per attention backend x AC mode (named
    ``reference/none``, ``chunked/selective2``, ...) and dtype (fp32; bf16 weights as under
    FSDP mixed precision): ``saved_bytes`` (what :func:`saved_for_backward` counts),
    ``peak_live_bytes`` (with ``peak``: the profiler's peak over the forward + backward; else
    0), ``sent`` (the bytes
    it hands to c10d ops over the step, counted as :class:`Communication` counts them) and the
    loss."""
    combos = _combos(attentions, acs, every)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "workers.log"
        args = [sys.executable, __file__, "--worker", str(cp), str(port), str(seq_len), tmp]
        with log.open("w") as sink:  # the profiler is chatty on stderr
            procs = [
                subprocess.Popen(
                    [*args, str(r), json.dumps(combos), str(int(peak))],
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
                for r in range(cp)
            ]
            codes = [p.wait(timeout=timeout) for p in procs]
        if codes != [0] * cp:
            raise RuntimeError(
                f"measurement workers failed with exit codes {codes}:\n{log.read_text()[-4000:]}"
            )
        return [json.loads((Path(tmp) / f"rank{r}").read_text()) for r in range(cp)]


def check(
    seq_len: int = CHECK_SEQ_LEN,
    degrees: tuple[int, ...] = CHECK_DEGREES,
    attentions: tuple[str, ...] = ATTENTIONS,
    acs: tuple[str, ...] = AC_MODES,
    every: int = 2,
    peak: bool = True,
) -> dict[str, Any]:
    """The debug model's bytes saved for the backward, predicted and measured, per attention
    backend x AC mode, dtype and CP degree: the busiest rank's figures, every rank's measured /
    predicted ratio and sent bytes, the peak of live bytes, and the measured saving against the
    first degree. ``worst_ratio``: the measured / predicted ratio furthest from 1, of all."""
    base = DeepSeekV4Config.from_flavor("debug").replace(
        attention_chunk_logits=CHECK_CHUNK_LOGITS, index_select_logits=CHECK_CHUNK_LOGITS
    )
    result: dict[str, Any] = {"model": "debug", "seq_len": seq_len, "batch": 1}
    runs = {cp: measure(seq_len, cp, attentions, acs, every, peak) for cp in degrees}
    worst = 1.0
    for attention, ac, _ in _combos(attentions, acs, every):
        combo = _combo_name(attention, ac, every)
        config = base.replace(attention_backend=attention)
        for name in DTYPES:
            act = 2 if name == "bf16" else FP32
            rows: dict[str, Any] = {}
            for cp, ranks in runs.items():
                predictions = [
                    predict(config, seq_len, cp, 1, act, r, ac=ac, ac_every=every)
                    for r in range(cp)
                ]
                predicted = [p.saved_bytes for p in predictions]
                measured = [rank[combo][name] for rank in ranks]
                saved = [m["saved_bytes"] for m in measured]
                ratios = [m / p for m, p in zip(saved, predicted, strict=True)]
                worst = max(worst, *ratios, key=lambda r: abs(r - 1))
                rows[f"cp{cp}"] = {
                    "comm_predicted_bytes": [p.communication.total for p in predictions],
                    "comm_measured_bytes": [m["sent"] for m in measured],
                    "predicted_mib": max(predicted) / 2**20,
                    "measured_mib": max(saved) / 2**20,
                    "ratio": max(saved) / max(predicted),
                    "rank_ratios": ratios,
                    "peak_live_mib": max(m["peak_live_bytes"] for m in measured) / 2**20,
                    "recompute_mib": max(p.recompute_bytes for p in predictions) / 2**20,
                }
            first = rows[f"cp{degrees[0]}"]["measured_mib"]
            for row in rows.values():
                row["measured_vs_first"] = row["measured_mib"] / first
            result.setdefault(combo, {})[name] = rows
    result["worst_ratio"] = worst
    return result


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="flash", help="ttnpu.dsv4 flavor (default flash)")
    parser.add_argument("--seq-len", type=int, default=1048576)
    parser.add_argument("--cp", type=int, default=128, help="context-parallel degree")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (FSDP figure)")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree (the dispatch's routed rows)"
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=DeepSeekV4Config.attention_backend,
        help="attention backend (default: the model's, chunked)",
    )
    parser.add_argument(
        "--ac",
        choices=(*AC_MODES, "op"),
        default="none",
        help="activation checkpointing: none, full (every block), selective (every "
        "--ac-every-th block); per-op selective (op) is not modelled",
    )
    parser.add_argument("--ac-every", type=int, default=2, help="selective: every N-th block")
    parser.add_argument(
        "--check",
        action="store_true",
        help="measure the debug model (CP 1/2/4, fp32 and bf16, every --attention x --ac "
        "unless given) against the prediction; ignores the other options",
    )
    parser.add_argument(
        "--no-peak",
        action="store_true",
        help="--check without the profiler's peak of live bytes (half the time)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        world, port, seq_len = (int(v) for v in argv[1:4])
        _worker(
            world, port, seq_len, Path(argv[4]), int(argv[5]), json.loads(argv[6]), argv[7] == "1"
        )
        return
    args = _parse(argv)
    if args.ac == "op":
        raise SystemExit("per-op selective AC (op) is not modelled: use none, full or selective")
    if args.check:
        given = {a.split("=")[0] for a in argv}
        attentions = (args.attention,) if "--attention" in given else ATTENTIONS
        acs = (args.ac,) if "--ac" in given else AC_MODES
        result = check(attentions=attentions, acs=acs, every=args.ac_every, peak=not args.no_peak)
        print(json.dumps(result))
        return
    config = DeepSeekV4Config.from_flavor(args.flavor).replace(attention_backend=args.attention)
    act = 2 if args.dtype == "bf16" else FP32
    p = [
        predict(
            config,
            args.seq_len,
            args.cp,
            args.batch,
            act,
            r,
            ac=args.ac,
            ac_every=args.ac_every,
            ep=args.ep,
        )
        for r in range(args.cp)
    ]
    busiest = max(p, key=lambda q: q.saved_bytes)
    prediction = _as_dict(busiest, max(p, key=lambda q: q.communication.total))
    out = {
        "flavor": args.flavor,
        "seq_len": args.seq_len,
        "cp": args.cp,
        "batch": args.batch,
        "dtype": args.dtype,
        "attention": args.attention,
        "ac": args.ac,
        **({"ac_every": args.ac_every} if args.ac == "selective" else {}),
        "ep": args.ep,
        **prediction,
        "fsdp_bytes_per_step_no_ep": fsdp_bytes(config, args.dp * args.cp, act),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
