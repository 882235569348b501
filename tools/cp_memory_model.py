"""Context-parallel memory and communication model of ttnpu-dsv4 (DeepSeek-V4), with its check.

``predict`` gives, for a config, a sequence length and a CP degree, the bytes autograd keeps from
the forward to the backward on one rank (the activation memory that context parallelism divides),
term by term, and the bytes each rank sends per forward + backward for CP. It is a closed-form
model of THIS implementation, derived by reading which tensors each op of ``ttnpu.dsv4`` saves
(the dense masked softmax over all compressed entries, the indexer's [L, heads, N] scores, the
mHC streams and 2 x iters Sinkhorn steps, the T x top-k grouped-matmul rows, ...): no term is
fitted to a measurement.

``measure`` runs the debug model's ``loss`` on CPU in gloo processes, one per CP rank
(subprocesses of this script), with fp32 weights and then bf16 weights (as FSDP's
``param_dtype`` gives the forward). Per rank it counts the distinct storages (by data_ptr, whole
``nbytes``; parameters and buffers excluded) of the tensors that ``saved_tensors_hooks`` saw being
saved and that the loss's graph still holds when the forward ends: exactly the memory that waits
for the backward. It also reports each rank's peak of live tensor bytes over the forward +
backward (the profiler's CPU allocation events), which adds transients and gradients.

Run:
    uv run python tools/cp_memory_model.py --flavor flash --seq-len 1048576 --cp 128
    uv run python tools/cp_memory_model.py --check   # debug model, 1001 tokens, CP 1/2/4, ~1 min

Each prints one JSON line. Bytes are per rank: the busiest one (rank 0, the longest slice).
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
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.context_parallel import compressor_halo, split

__all__ = [
    "Communication",
    "Prediction",
    "cast_weights",
    "check",
    "fsdp_bytes",
    "measure",
    "predict",
    "saved_for_backward",
]

FP32 = 4
INT64 = 8
GIB = 2**30
CHECK_SEQ_LEN = 1001  # a multiple of none of the block sizes (4, 16), the window (32) or CP 2/4
CHECK_DEGREES = (1, 2, 4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # measured in this order

# The terms of the bytes kept for the backward, in the order printed.
TERMS = (
    "embedding",  # token ids, the embedding output the first layer's streams expand
    "mhc_streams",  # the n residual streams entering every mHC site and hc_head
    "mhc_mixing",  # pre/post/comb mixes and gates, 2 * iters Sinkhorn steps
    "attention_qkv",  # attn_norm, q/kv low-rank projections, q/kv norms, rotated q, window keys
    "window_probs",  # softmax probabilities over the W window keys and the sink [L, H, W + 1]
    "entry_probs",  # ... over ALL N compressed entries [L, H, N] (masked, dense)
    "compressed_entries",  # compressor inputs, gated pooling, norm, the gathered entries
    "indexer",  # its compressor, q, gathered keys, relu scores [L, IH, N], distillation KL
    "attention_output",  # grouped output projection and the sub-layer output
    "rope_tables",  # cos/sin tables (per forward, per compressor, inverse per layer)
    "moe_router",  # ffn_norm, gate scores, combine weights, balance loss
    "moe_routed",  # top-k rows through the grouped experts (clamped SwiGLU)
    "moe_shared",  # the shared expert, and the MoE output (routed + shared) hc_post keeps
    "head",  # final hc_head and norm, fp32 log-probabilities [L, vocab], labels
    "mtp",  # the MTP block: projections, one sliding-window block, its hc_head, norm and head
    "weight_casts",  # bf16 weights only: their fp32 copies that the fp32 islands keep (mHC
    # mixers, routers, attention compressors): per die whatever the CP degree
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

    @property
    def total(self) -> float:
        return (
            self.window_halo
            + self.compressor_halo
            + self.entries_all_gather
            + self.entries_reduce_scatter
            + self.statistics_all_reduce
        )


@dataclass
class Prediction:
    """Bytes saved for the backward per term and CP communication bytes, for one rank."""

    rank: int
    tokens: int  # this rank's slice length
    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    communication: Communication = field(default_factory=Communication)

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

    @property
    def tokens(self) -> int:  # B * L: rows of every per-token activation
        return self.batch * (self.stop - self.start)

    @property
    def length(self) -> int:  # L: rows of the tensors that are the same for every sequence
        return self.stop - self.start

    @property
    def rank(self) -> int:
        return split(self.seq_len, self.cp).index((self.start, self.stop))

    def directions(self, *, backward: bool) -> int:
        """How many halos this rank sends: forward to the next rank (all but the last), and
        with ``backward`` the gradient to the previous one (all but the first)."""
        return int(self.rank < self.cp - 1) + int(backward and self.rank > 0)


def _norm(rows: int, width: int) -> float:
    """RMSNorm on [rows, width], fp32 inside: its input as fp32 (the input itself in fp32, a copy
    otherwise), the normalised product, and the [rows, 1] rsqrt. Its output belongs to the
    consumer that saves it."""
    return 2 * FP32 * rows * width + FP32 * rows


class _Model:
    """The closed-form terms, one method per part of the code they come from."""

    def __init__(self, config: DeepSeekV4Config, act: int) -> None:
        self.c, self.a = config, act
        self.upcast = FP32 if act != FP32 else 0  # bytes of an extra fp32 copy (x.float())

    # mHC ---------------------------------------------------------------------------------------
    def site_mixing(self, t: int) -> float:
        """hc_pre + hc_post of one site, without the streams and the sub-layer output."""
        n, iters = self.c.hc_mult, self.c.hc_sinkhorn_iters
        mixes = 2 * FP32 * t * (2 + n) * n + FP32 * t  # matmul output, scaled mix, rsqrt
        gates = 3 * FP32 * t * n  # sigmoid(pre), pre + eps, sigmoid(post)
        post = self.a * t * n  # 2 * sigmoid(post) as hc_post saves it (cast to the streams')
        sinkhorn = FP32 * t * (2 * iters * n * n + (2 * iters - 1) * n)
        comb = self.a * t * n * n if self.a != FP32 else 0  # comb cast for hc_post
        return mixes + gates + post + sinkhorn + comb

    def streams(self, t: int) -> float:
        """One [T, n, dim] stream tensor as a site saves it (plus its fp32 copy off fp32)."""
        return (self.a + self.upcast) * t * self.c.hc_mult * self.c.dim

    def hc_head(self, t: int) -> tuple[float, float]:
        """(streams, mixing) of an hc_head collapse."""
        n = self.c.hc_mult
        return self.streams(t), FP32 * t + 4 * FP32 * t * n

    # Attention ---------------------------------------------------------------------------------
    def attention(
        self, s: _Slice, ratio: int, terms: dict[str, float], comm: Communication
    ) -> None:
        c, a, t, ln = self.c, self.a, s.tokens, s.length
        h, d, w = c.n_heads, c.head_dim, c.window_size
        qkv = _norm(t, c.dim) + a * t * c.dim  # attn_norm and its output (wq_a, wkv inputs)
        qkv += _norm(t, c.q_lora_rank) + a * t * c.q_lora_rank  # q_norm, qr (wq_b's input)
        qkv += a * t * h * d + FP32 * t * h  # wq_b output and its per-head rms (rms_normalize)
        qkv += (self.upcast * t * h * d + a * t * h) if a != FP32 else 0
        qkv += a * t * h * d  # rotated q
        qkv += _norm(t, d)  # kv_norm (its output is only rotated: not saved)
        qkv += self.window_keys(s)
        terms["attention_qkv"] += qkv
        terms["rope_tables"] += FP32 * ln * c.rope_head_dim // 2  # -sin of the inverse rotation
        terms["window_probs"] += FP32 * t * h * (w + 1) + ln * w  # probs, ~window_mask
        entries = 0
        if ratio:
            entries = s.seq_len // ratio
            csa = c.is_csa(ratio)
            mask = (s.batch if csa else 1) * ln * entries  # ~reads (bool): per sequence on CSA
            terms["entry_probs"] += FP32 * t * h * entries + mask
            own = self.compressor(s, ratio, d, terms, comm, overlap=csa, indexer=False)
            terms["compressed_entries"] += own
            if csa:
                self.indexer(s, ratio, terms, comm)
        if a != FP32:  # probs cast back for the value matmuls
            terms["window_probs"] += a * t * h * (w + 1)
            terms["entry_probs"] += a * t * h * entries
        out = a * t * h * d + a * t * c.o_groups * c.o_lora_rank  # grouped copy, wo_b input
        terms["attention_output"] += out + a * t * c.dim  # + the output (hc_post saves it)
        # Window halo: W - 1 kv rows to the next rank, their gradient back to the previous one.
        comm.window_halo += s.directions(backward=True) * a * s.batch * (w - 1) * d

    def window_keys(self, s: _Slice) -> float:
        """The banded window keys (an unfold view of halo + slice). With more than one sequence
        the view cannot be folded into the matmuls' batch, so each of the two window matmuls
        saves a [B * L, W, D] copy instead."""
        c = self.c
        if s.batch == 1:
            return self.a * (s.length + c.window_size - 1) * c.head_dim
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
        size += _norm(s.batch * computed, width)
        # The attention's entries are saved as they come (activation dtype); the indexer's keys
        # are cast to fp32 before they are saved.
        size += (FP32 if indexer else a) * s.batch * n_all * width
        if s.cp > 1:
            size += INT64 * n_all  # the index that drops the all-gather's padding
        terms["rope_tables"] += 2 * FP32 * rows * c.rope_head_dim // 2  # span table cos, sin
        if s.cp > 1:
            bounds = split(s.seq_len, s.cp)
            halo = max(compressor_halo(st, ratio, overlap) for st, _ in bounds)
            directions = s.directions(backward=not indexer)
            comm.compressor_halo += directions * a * s.batch * halo * c.dim
            width_max = max(b // ratio - st // ratio for st, b in bounds)
            ring = (s.cp - 1) * a * s.batch * width_max * width  # padded all_gather_single
            comm.entries_all_gather += ring
            comm.entries_reduce_scatter += ring
        return size

    def indexer(self, s: _Slice, ratio: int, terms: dict[str, float], comm: Communication) -> None:
        c, t, ln = self.c, s.tokens, s.length
        ih, n_all = c.index_n_heads, s.seq_len // ratio
        size = self.compressor(s, ratio, c.index_head_dim, terms, comm, overlap=True, indexer=True)
        size += self.upcast * t * c.dim  # weights_proj's fp32 input (off fp32 only)
        size += FP32 * t * ih * c.index_head_dim  # rotated q (fp32)
        size += FP32 * t * ih * n_all + FP32 * t * ih  # relu(q . K) [L, IH, N], head weights
        # ~visible; the scores and top-k indices that select() saves are in a dead branch (freed)
        size += ln * n_all
        size += s.batch * ln * n_all + 2 * FP32 * t * n_all + t  # KL: ~reads, log_softmax, p
        terms["indexer"] += size
        if s.cp > 1:  # the query count of the KL mean (int64 scalar)
            comm.statistics_all_reduce += 2 * (s.cp - 1) / s.cp * INT64

    # MoE ---------------------------------------------------------------------------------------
    def moe(
        self, s: _Slice, hash_routed: bool, terms: dict[str, float], comm: Communication
    ) -> None:
        c, a, t = self.c, self.a, s.tokens
        e, k, dim, inter = c.n_routed_experts, c.n_activated_experts, c.dim, c.moe_inter_dim
        router = _norm(t, dim) + a * t * dim + self.upcast * t * dim  # ffn_norm, its output
        router += 2 * FP32 * t * e  # softplus input, sqrt output
        router += INT64 * t * k + FP32 * t * k + FP32 * t  # indices, picked scores, their sum
        if not hash_routed:  # balance loss: score sums and the count vector
            router += FP32 * t + FP32 * s.batch * e
            if s.cp > 1:
                comm.statistics_all_reduce += 2 * (s.cp - 1) / s.cp * FP32 * s.batch * e
        terms["moe_router"] += router
        rows = t * k
        routed = 2 * INT64 * rows + 4 * e  # expert order and token ids, group offsets
        routed += a * rows * dim + 6 * a * rows * inter  # gathered rows, SwiGLU internals
        routed += 2 * a * rows * dim + a * rows  # expert output, weighted output, weights
        terms["moe_routed"] += routed
        terms["moe_shared"] += 6 * a * t * c.n_shared_experts * inter

    # The whole model ---------------------------------------------------------------------------
    def block(
        self,
        s: _Slice,
        ratio: int,
        hash_routed: bool,
        terms: dict[str, float],
        comm: Communication,
        first: bool,
    ) -> None:
        """One Block: two mHC sites around attention and MoE. ``first``: its input is the
        embedding expanded to n streams (saved as the embedding plus a flattened fp32 copy)."""
        t = s.tokens
        if first:
            terms["embedding"] += self.a * t * self.c.dim
            terms["mhc_streams"] += FP32 * t * self.c.hc_mult * self.c.dim + self.streams(t)
        else:
            terms["mhc_streams"] += 2 * self.streams(t)
        terms["mhc_mixing"] += 2 * self.site_mixing(t)
        self.attention(s, ratio, terms, comm)
        self.moe(s, hash_routed, terms, comm)
        terms["weight_casts"] += self.weight_casts(ratio)
        terms["moe_shared"] += self.a * t * self.c.dim  # the MoE output (hc_post saves it)

    def weight_casts(self, ratio: int) -> float:
        """fp32 copies of a block's bf16 weights that ``.float()`` makes and autograd keeps:
        two mHC mixers, the router, the attention compressor's projections (not the indexer's:
        its inputs are detached, so no input gradient needs its weights)."""
        if self.a == FP32:
            return 0
        c, n = self.c, self.c.hc_mult
        params = 2 * (2 + n) * n * n * c.dim + c.n_routed_experts * c.dim
        if ratio:
            csa = c.is_csa(ratio)
            params += 2 * (1 + csa) * c.head_dim * c.dim  # wkv, wgate
        return FP32 * params

    def hc_head_casts(self) -> float:
        """The fp32 copy of an hc_head mixer (bf16 only)."""
        return 0 if self.a == FP32 else FP32 * self.c.hc_mult**2 * self.c.dim

    def head(self, s: _Slice) -> float:
        """hc_head mixing, final norm and its output, fp32 log-probabilities, the labels."""
        t = s.tokens
        return (
            self.hc_head(t)[1]
            + _norm(t, self.c.dim)
            + self.a * t * self.c.dim
            + FP32 * t * self.c.vocab_size
            + INT64 * s.batch * s.seq_len
        )


def predict(
    config: DeepSeekV4Config,
    seq_len: int,
    cp: int,
    batch: int = 1,
    activation_bytes: int = 2,
    rank: int | None = None,
) -> Prediction:
    """The bytes autograd keeps on one CP rank from one ``loss`` forward of ``batch`` sequences
    of ``seq_len`` tokens to its backward, and the CP bytes the rank sends per forward +
    backward.

    ``activation_bytes``: 2 for bf16 activations (mixed precision), 4 for fp32; the fp32 islands
    of the code (softmax, norms, compressors, indexer, losses) are fp32 either way. ``rank``:
    default the busiest one (rank 0, which holds the longest slice)."""
    if activation_bytes not in (2, 4):
        raise ValueError(f"activation_bytes must be 2 (bf16) or 4 (fp32), got {activation_bytes}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if config.indexer_stage != "sparse":
        raise ValueError(
            "the model covers the sparse indexer stage; in the dense warm-up only the indexers' "
            f"graph is kept (indexer_stage={config.indexer_stage!r})"
        )
    bounds = split(seq_len, cp)
    rank = 0 if rank is None else rank
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}")
    start, stop = bounds[rank]
    s = _Slice(batch, start, stop, seq_len, cp)
    model = _Model(config, activation_bytes)
    out = Prediction(rank, stop - start)
    terms, comm = out.terms, out.communication
    c, t = config, s.tokens
    terms["embedding"] += INT64 * batch * seq_len  # the token ids (a slice of the whole)
    terms["rope_tables"] += 2 * FP32 * s.length * c.rope_head_dim // 2  # main cos, sin
    if any(c.compress_ratios):
        terms["rope_tables"] += 2 * FP32 * s.length * c.rope_head_dim // 2  # compress cos, sin
    for layer, ratio in enumerate(c.compress_ratios):
        model.block(s, ratio, c.is_hash_layer(layer), terms, comm, first=layer == 0)
    terms["mhc_streams"] += model.hc_head(t)[0]  # the last block's output, read by hc_head
    terms["head"] += model.head(s)
    if c.n_mtp_layers and seq_len > 1:
        mtp = dict.fromkeys(TERMS, 0.0)
        rows = t * c.hc_mult  # hnorm normalises each stream of the main body's output
        mtp["mtp"] += INT64 * t + _norm(t, c.dim) + activation_bytes * t * c.dim  # enorm, e_proj
        mtp["mtp"] += (model.upcast + FP32) * rows * c.dim + FP32 * rows  # hnorm (fp32 input:
        # the streams themselves in fp32, already counted; a copy otherwise), normalised, rsqrt
        mtp["mtp"] += activation_bytes * rows * c.dim  # hnorm output (h_proj input)
        mtp["mtp"] += 2 * FP32 * s.length * c.rope_head_dim // 2  # its own main cos, sin
        model.block(s, 0, False, mtp, comm, first=False)
        mtp["mtp"] += model.streams(t) + model.head(s)
        terms["weight_casts"] += mtp.pop("weight_casts") + model.hc_head_casts()
        terms["mtp"] += sum(mtp.values())
    terms["weight_casts"] += model.hc_head_casts()
    return out


def _as_dict(p: Prediction, busiest: Prediction) -> dict[str, Any]:
    """``p``'s memory; ``busiest``'s communication (the rank that sends the most)."""
    comm = busiest.communication
    return {
        "rank": p.rank,
        "tokens": p.tokens,
        "saved_gib": p.saved_bytes / GIB,
        "terms_gib": {k: v / GIB for k, v in p.terms.items()},
        "comm_rank": busiest.rank,
        "comm_bytes_per_step": {
            "window_halo": comm.window_halo,
            "compressor_halo": comm.compressor_halo,
            "entries_all_gather": comm.entries_all_gather,
            "entries_reduce_scatter": comm.entries_reduce_scatter,
            "statistics_all_reduce": comm.statistics_all_reduce,
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
    model: DeepSeekV4, tokens: torch.Tensor, labels: torch.Tensor, world: int
) -> dict[str, float]:
    """One forward + backward: the loss, the bytes saved for the backward, the peak of live CPU
    tensor bytes over the step relative to what was live before it (the running sum of the
    profiler's allocation (+) and free (-) events), and the bytes sent (:class:`_SentBytes`)."""
    from torch.profiler import ProfilerActivity, profile

    memory = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    comm = _SentBytes(world)
    with memory as prof, comm if world > 1 else nullcontext():  # nothing to send on one rank
        loss, saved = saved_for_backward(model, tokens, labels)
        loss.backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return {"loss": loss.item(), "saved_bytes": saved, "peak_live_bytes": peak, "sent": comm.sent}


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


def _worker(world: int, port: int, seq_len: int, folder: Path, rank: int) -> None:
    """One CP rank of :func:`measure`: writes its figures per dtype to ``folder/rank{rank}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ttnpu.dsv4.parallel import apply_context_parallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DeepSeekV4(DeepSeekV4Config.from_flavor("debug"))
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        apply_context_parallel(model, init_device_mesh("cpu", (world,)))
    tokens, labels = _batch(model.config, seq_len)
    result = {}
    for name, dtype in DTYPES.items():
        cast_weights(model, dtype)
        result[name] = _measure_step(model, tokens, labels, world)
    (folder / f"rank{rank}").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _batch(config: DeepSeekV4Config, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator)
    return tokens, torch.roll(tokens, -1, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(
    seq_len: int = CHECK_SEQ_LEN, cp: int = 1, timeout: float = 600
) -> list[dict[str, dict[str, float]]]:
    """Per rank of the debug model (batch 1, CPU) under CP degree ``cp`` (real gloo processes),
    per dtype (fp32; bf16 weights as under FSDP mixed precision): ``saved_bytes`` (what
    :func:`saved_for_backward` counts), ``peak_live_bytes`` (the profiler's peak over the
    forward + backward), ``sent`` (the bytes it hands to c10d ops over the step, counted as
    :class:`Communication` counts them) and the loss."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "workers.log"
        args = [sys.executable, __file__, "--worker", str(cp), str(port), str(seq_len), tmp]
        with log.open("w") as sink:  # the profiler is chatty on stderr
            procs = [
                subprocess.Popen([*args, str(r)], env=env, stdout=sink, stderr=subprocess.STDOUT)
                for r in range(cp)
            ]
            codes = [p.wait(timeout=timeout) for p in procs]
        if codes != [0] * cp:
            raise RuntimeError(
                f"measurement workers failed with exit codes {codes}:\n{log.read_text()[-4000:]}"
            )
        return [json.loads((Path(tmp) / f"rank{r}").read_text()) for r in range(cp)]


def check(seq_len: int = CHECK_SEQ_LEN, degrees: tuple[int, ...] = CHECK_DEGREES) -> dict[str, Any]:
    """The debug model's bytes saved for the backward, predicted and measured, per dtype and CP
    degree: the busiest rank's figures, every rank's measured / predicted ratio, the peak of
    live bytes, and the measured saving against CP 1."""
    config = DeepSeekV4Config.from_flavor("debug")
    result: dict[str, Any] = {"model": "debug", "seq_len": seq_len, "batch": 1}
    runs = {cp: measure(seq_len, cp) for cp in degrees}
    for name in DTYPES:
        act = 2 if name == "bf16" else FP32
        rows: dict[str, Any] = {}
        for cp, ranks in runs.items():
            predictions = [predict(config, seq_len, cp, 1, act, r) for r in range(cp)]
            predicted = [p.saved_bytes for p in predictions]
            saved = [rank[name]["saved_bytes"] for rank in ranks]
            rows[f"cp{cp}"] = {
                "comm_predicted_bytes": [p.communication.total for p in predictions],
                "comm_measured_bytes": [rank[name]["sent"] for rank in ranks],
                "predicted_mib": max(predicted) / 2**20,
                "measured_mib": max(saved) / 2**20,
                "ratio": max(saved) / max(predicted),
                "rank_ratios": [m / p for m, p in zip(saved, predicted, strict=True)],
                "peak_live_mib": max(rank[name]["peak_live_bytes"] for rank in ranks) / 2**20,
            }
        first = rows[f"cp{degrees[0]}"]["measured_mib"]
        for row in rows.values():
            row["measured_vs_first"] = row["measured_mib"] / first
        result[name] = rows
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
        "--check",
        action="store_true",
        help="measure the debug model (CP 1/2/4, fp32 and bf16) against the prediction; "
        "ignores the other options",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        world, port, seq_len = (int(v) for v in argv[1:4])
        _worker(world, port, seq_len, Path(argv[4]), int(argv[5]))
        return
    args = _parse(argv)
    if args.check:
        print(json.dumps(check()))
        return
    config = DeepSeekV4Config.from_flavor(args.flavor)
    act = 2 if args.dtype == "bf16" else FP32
    ranks = {0, min(1, args.cp - 1), args.cp - 1}  # the first, a middle and the last rank
    p = [predict(config, args.seq_len, args.cp, args.batch, act, r) for r in sorted(ranks)]
    prediction = _as_dict(p[0], max(p, key=lambda q: q.communication.total))
    out = {
        "flavor": args.flavor,
        "seq_len": args.seq_len,
        "cp": args.cp,
        "batch": args.batch,
        "dtype": args.dtype,
        **prediction,
        "fsdp_bytes_per_step_no_ep": fsdp_bytes(config, args.dp * args.cp, act),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
