"""Mixture of experts: sqrt-softplus gate, aux-loss-free selection bias, hash-routed first layers,
clamped SwiGLU experts run through one grouped matmul, a shared expert, the sequence-wise balance
loss and the bias update (outside autograd).

Routing protocol (what ttnpu-routing drives, without importing this package): every learned-gate
:class:`Router` has ``num_experts``, ``top_k``, ``last_indices`` (the [tokens, top_k] int64 choice
of its latest forward) and ``force_indices(indices | None)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .config import DeepSeekV4Config
from .context_parallel import SequenceShard

__all__ = [
    "Dispatch",
    "Expert",
    "GroupedExperts",
    "HashRouter",
    "MoE",
    "Router",
    "balance_loss",
    "gate_scores",
    "grouped_linear",
    "local_dispatch",
    "local_tensor",
    "swiglu_clamped",
    "update_expert_bias",
]


def gate_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x W^T))`` in fp32: non-negative affinities [tokens, experts]."""
    return F.softplus(x.float() @ weight.float().t()).sqrt()


def _combine_weights(
    scores: torch.Tensor, indices: torch.Tensor, route_scale: float
) -> torch.Tensor:
    """Unbiased scores at the chosen experts, renormalised to sum to ``route_scale``."""
    picked = scores.gather(1, indices)
    return picked / picked.sum(dim=-1, keepdim=True) * route_scale


class Router(nn.Module):
    """Learned gate: ``TopK(s + bias)`` chooses, unbiased ``s`` weighs."""

    def __init__(self, dim: int, num_experts: int, top_k: int, route_scale: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.route_scale = num_experts, top_k, route_scale
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=torch.float32))
        self.name = "router"
        self.last_indices: torch.Tensor | None = None
        self._forced: torch.Tensor | None = None

    def force_indices(self, indices: torch.Tensor | None) -> None:
        """Use ``indices`` [tokens, top_k] (int64, in range) instead of choosing, until None."""
        if indices is not None:
            if indices.dtype != torch.int64:
                raise ValueError(f"{self.name}: forced indices must be int64, got {indices.dtype}")
            if indices.dim() != 2 or indices.shape[1] != self.top_k:
                raise ValueError(
                    f"{self.name}: forced indices must have shape [tokens, {self.top_k}], "
                    f"got {list(indices.shape)}"
                )
            if indices.numel() and (indices.min() < 0 or indices.max() >= self.num_experts):
                raise ValueError(
                    f"{self.name}: forced indices must lie in [0, {self.num_experts}), got "
                    f"[{int(indices.min())}, {int(indices.max())}]"
                )
        self._forced = indices

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (combine weights [T, k], indices [T, k] int64, scores [T, E])."""
        scores = gate_scores(x, self.weight)
        if self._forced is not None:
            if self._forced.shape[0] != x.shape[0]:
                raise ValueError(
                    f"{self.name}: forced indices cover {self._forced.shape[0]} tokens, this "
                    f"forward has {x.shape[0]}"
                )
            indices = self._forced.to(x.device)
        else:
            with torch.no_grad():
                indices = (scores + bias).topk(self.top_k, dim=-1).indices
        self.last_indices = indices.detach()
        return _combine_weights(scores, indices, self.route_scale), indices, scores

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        self.last_indices = None


class HashRouter(nn.Module):
    """First layers: experts fixed per token id by the frozen ``tid2eid`` table; the learned gate
    only weighs them. Not a routing-protocol router (nothing to capture or replay)."""

    tid2eid: torch.Tensor

    def __init__(
        self, dim: int, vocab_size: int, num_experts: int, top_k: int, route_scale: float, seed: int
    ) -> None:
        super().__init__()
        self.num_experts, self.route_scale, self.seed = num_experts, route_scale, seed
        self.hash_top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=torch.float32))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int32))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = gate_scores(x, self.weight)
        indices = self.tid2eid[token_ids.reshape(-1)].long()
        return _combine_weights(scores, indices, self.route_scale), indices, scores

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.tid2eid.is_meta:
            return
        # Per token id, top-k of rand(num_experts): k distinct experts, from a fixed seed.
        generator = torch.Generator().manual_seed(self.seed)
        rows = []
        for start in range(0, self.tid2eid.shape[0], 8192):
            count = min(8192, int(self.tid2eid.shape[0]) - start)
            noise = torch.rand(count, self.num_experts, generator=generator)
            rows.append(noise.topk(self.hash_top_k, dim=-1).indices)
        self.tid2eid.copy_(torch.cat(rows).to(torch.int32))


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (asymmetric clamp)."""
    out: torch.Tensor = _SwiGLU.apply(gate, up, None, limit)
    return out


def _swiglu_parts(
    gate: torch.Tensor, up: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min(gate, limit), its silu, clamp(up, -limit, limit), their product)."""
    clamped = gate.clamp(max=limit)
    activated, clamped_up = F.silu(clamped), up.clamp(-limit, limit)
    return clamped, activated, clamped_up, activated * clamped_up


def _swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float
) -> torch.Tensor:
    hidden = F.silu(gate.clamp(max=limit)).mul_(up.clamp(-limit, limit))
    return hidden if weights is None else hidden.mul_(_column(weights, hidden))


def _column(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return weights.unsqueeze(-1).to(like.dtype)


def _swiglu_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    weights: torch.Tensor | None,
    parts: list[torch.Tensor],
    weights_grad: bool,
    *,
    grad_is_temporary: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of gate, up (and of the per-row weights) from that of the (weighted) hidden
    activations, given ``_swiglu_parts`` as a list that this empties (each part is freed once
    used); ``grad_is_temporary``: ``grad`` may be overwritten. Clamp passes the gradient where
    its input lies inside the bounds (where it returned its input), as autograd's clamp does."""
    clamped, activated, clamped_up, product = parts
    parts.clear()
    grad_weights = None
    if weights is not None:
        if weights_grad:
            grad_weights = (grad * product).sum(dim=-1).to(weights.dtype)
        column = _column(weights, grad)
        grad = grad.mul_(column) if grad_is_temporary else grad * column
        grad_is_temporary = True
    del product
    grad_up = (grad * activated).mul_(clamped_up == up)
    del activated
    grad = grad.mul_(clamped_up) if grad_is_temporary else grad * clamped_up
    del clamped_up
    grad_gate = torch.ops.aten.silu_backward(grad, clamped)
    del grad
    return grad_gate.mul_(clamped == gate), grad_up, grad_weights


class _SwiGLU(torch.autograd.Function):
    """Clamped SwiGLU (times optional per-row weights) that saves only its inputs."""

    @staticmethod
    def forward(
        ctx: Any, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weights)
        ctx.limit = limit
        return _swiglu_forward(gate, up, weights, limit)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        gate, up, weights = ctx.saved_tensors
        parts = list(_swiglu_parts(gate, up, ctx.limit))
        grads = _swiglu_backward(grad, gate, up, weights, parts, ctx.needs_input_grad[2])
        return *grads, None


def _grouped_mm_native(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype in (torch.float32, torch.bfloat16) and a.dtype == b.dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x (sorted by expert) times weight[e]^T; ``torch._grouped_mm`` (fp32 and bf16 on CPU
    in torch 2.14), else one padded batched matmul for other dtypes."""
    if _grouped_mm_native(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    starts = offsets.long() - counts
    expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(len(counts), int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded = padded.index_put((expert, slot), x)
    return torch.bmm(padded, weight.transpose(-2, -1))[expert, slot]


def _rows_times(
    rows: torch.Tensor, mats: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """``rows[group e] @ mats[e]`` for rows sorted by group: [R, K] x [E, K, N] -> [R, N]
    (``offsets`` None: one group, mats [K, N])."""
    if offsets is None:
        return rows @ mats
    if _grouped_mm_native(rows, mats):
        return torch._grouped_mm(rows, mats, offs=offsets)
    return grouped_linear(rows, mats.transpose(-2, -1), offsets)


def _per_group_outer(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """``a[group e]^T @ b[group e]`` for rows sorted by group: [R, M], [R, N] -> [E, M, N]
    (zero for an empty group): the weight gradient of a grouped matmul (``offsets`` None: one
    group, [M, N])."""
    if offsets is None:
        return a.t() @ b
    if _grouped_mm_native(a, b):
        return torch._grouped_mm(a.t(), b, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    parts = zip(a.split(counts), b.split(counts), strict=True)
    return torch.stack([part_a.t() @ part_b for part_a, part_b in parts])


def _projections(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    offsets: torch.Tensor | None,
    token_of: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rows in expert order, their gate projections, their up projections)."""
    rows = x if token_of is None else x.index_select(0, token_of)
    gate = _rows_times(rows, w1.transpose(-2, -1), offsets)
    return rows, gate, _rows_times(rows, w3.transpose(-2, -1), offsets)


class _RoutedExperts(torch.autograd.Function):
    """Gather the rows of x in expert order (``token_of``; None: x is already sorted), run the
    clamped SwiGLU experts through grouped matmuls (``offsets`` None: one expert, plain matmuls
    with 2-D weights), weigh each row (``weights``, or not) and add the rows back onto their
    tokens (``token_of``; None: return the rows).

    Saves x, the row order and weights; with ``recompute`` only those: the backward gathers the
    rows again and recomputes the gate and up projections (two grouped matmuls of the nine; the
    same ops, so the forward's values bit for bit), else it keeps the two [rows, inter]
    projections too (~7% faster steps on the debug model at 256 tokens, 60 MiB more at 2048).

    ``dtype``: compute in it, the weights cast inside (expert-parallel experts sit outside
    FSDP's mixed precision); the backward casts them again rather than keeping the casts, which
    would hold a copy of every local expert per MoE layer until the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        offsets: torch.Tensor | None,
        token_of: torch.Tensor | None,
        weights: torch.Tensor | None,
        limit: float,
        recompute: bool,
        dtype: torch.dtype | None,
    ) -> torch.Tensor:
        given = x, w1, w2, w3
        ctx.limit, ctx.dtype = limit, dtype
        if dtype is not None:
            x, w1, w2, w3 = (t.to(dtype) for t in given)
        rows, gate, up = _projections(x, w1, w3, offsets, token_of)
        hidden = _swiglu_forward(gate, up, weights, limit)
        out = _rows_times(hidden, w2.transpose(-2, -1), offsets)
        kept = () if recompute else (gate, up)
        ctx.save_for_backward(*given, offsets, token_of, weights, *kept)
        del rows, gate, up, kept, given
        if token_of is None:
            return out
        return x.new_zeros(x.shape).index_add_(0, token_of, out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, w3, offsets, token_of, weights, *kept = ctx.saved_tensors
        needs = ctx.needs_input_grad
        given = x.dtype, w1.dtype, w2.dtype, w3.dtype
        if ctx.dtype is not None:
            x, w1, w2, w3 = (t.to(ctx.dtype) for t in (x, w1, w2, w3))
        # Every temporary is dropped once used: the backward's peak is the saved tensors plus a
        # few [rows, dim] and [rows, inter] temporaries at a time.
        if kept:
            rows = x if token_of is None else x.index_select(0, token_of)
            gate, up = kept
            del kept
        else:
            rows, gate, up = _projections(x, w1, w3, offsets, token_of)
        parts = list(_swiglu_parts(gate, up, ctx.limit))
        grad = grad.contiguous()
        grad_out = grad if token_of is None else grad.index_select(0, token_of)
        del grad
        grad_w2 = None
        if needs[2]:
            hidden = parts[3] if weights is None else parts[3] * _column(weights, parts[3])
            grad_w2 = _per_group_outer(grad_out, hidden, offsets)
            del hidden
        grad_hidden = _rows_times(grad_out, w2, offsets)
        del grad_out
        grad_gate, grad_up, grad_weights = _swiglu_backward(
            grad_hidden, gate, up, weights, parts, needs[6], grad_is_temporary=True
        )
        del grad_hidden, gate, up
        grad_x = grad_w1 = grad_w3 = None
        grad_w1 = _per_group_outer(grad_gate, rows, offsets) if needs[1] else None
        grad_w3 = _per_group_outer(grad_up, rows, offsets) if needs[3] else None
        del rows
        if needs[0]:
            grad_rows = _rows_times(grad_gate, w1, offsets)
            del grad_gate
            grad_rows += _rows_times(grad_up, w3, offsets)
            del grad_up
            if token_of is None:
                grad_x = grad_rows
            else:
                grad_x = x.new_zeros(x.shape).index_add_(0, token_of, grad_rows)
        grads = (grad_x, grad_w1, grad_w2, grad_w3)
        grad_x, grad_w1, grad_w2, grad_w3 = (
            None if g is None else g.to(dtype) for g, dtype in zip(grads, given, strict=True)
        )
        return grad_x, grad_w1, grad_w2, grad_w3, None, None, grad_weights, None, None, None


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight: the local shard of a DTensor (differentiably), else itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """Routed experts as stacked weights: w1, w3 [E, inter, dim] (gate, up); w2 [E, dim, inter].

    Under expert parallelism the weights are DTensors sharded on dim 0 over the EP mesh; the
    forward runs this rank's ``local_experts`` of them, and ``grad_scale`` multiplies their
    gradients (a tensor hook would not survive ``to_empty``). Such experts sit outside FSDP, so
    ``param_dtype`` (set from FSDP's mixed-precision policy) casts them for the forward."""

    grad_scale: float = 1.0
    param_dtype: torch.dtype | None = None
    recompute_projections: bool = True
    """Recompute the rows' gate and up projections in the backward instead of keeping them
    (2 x top-k x inter values per token; see :class:`_RoutedExperts`)."""

    def __init__(self, num_experts: int, dim: int, inter_dim: int, swiglu_limit: float) -> None:
        super().__init__()
        self.num_experts, self.swiglu_limit = num_experts, swiglu_limit
        self.w1 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, inter_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter_dim, dim))

    @property
    def local_experts(self) -> int:
        """How many experts this rank runs (all of them without expert parallelism)."""
        return int(local_tensor(self.w1).shape[0])

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        token_of: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [R, dim] sorted by local expert, ``tokens_per_expert`` [local_experts] -> [R, dim],
        each row's output times ``weights`` [R] (the rows' combine weights) if given.

        With ``token_of`` [R] (the token of each expert-sorted row) x is the tokens [T, dim]: the
        rows are gathered from it, and the output [T, dim] is each token's sum of its rows'
        (weighted) outputs."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        out: torch.Tensor = _RoutedExperts.apply(
            x,
            w1,
            w2,
            w3,
            offsets,
            token_of,
            weights,
            self.swiglu_limit,
            self.recompute_projections,
            self.param_dtype or w1.dtype,
        )
        return out

    def reset_parameters(self, std: float) -> None:
        for weight in (self.w1, self.w2, self.w3):
            nn.init.normal_(weight, std=std)


class Expert(nn.Module):
    """The shared expert: the same clamped SwiGLU as the routed ones."""

    recompute_projections: bool = True
    """As :attr:`GroupedExperts.recompute_projections` (2 x inter values per token)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim] (one node: saves x and the two [T, inter] projections)."""
        w1, w2, w3 = self.w1.weight, self.w2.weight, self.w3.weight
        rows = x.reshape(-1, x.shape[-1])
        out = _RoutedExperts.apply(
            rows, w1, w2, w3, None, None, None, self.swiglu_limit, self.recompute_projections, None
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    def reset_parameters(self, std: float) -> None:
        for linear in (self.w1, self.w2, self.w3):
            nn.init.normal_(linear.weight, std=std)


Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "GroupedExperts"], torch.Tensor]


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Long [num_experts]: how many of ``indices`` (any shape, values in range) name each
    expert. ``torch.bincount`` with a static output shape (its own depends on the values), so
    that fake-tensor tracing and ``torch.compile`` see a fixed shape."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def local_dispatch(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
) -> torch.Tensor:
    """Sort the (token, expert) pairs by expert, run the grouped experts, scatter-add back."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // indices.shape[1]
    counts = expert_counts(flat, experts.num_experts)
    return experts(x, counts, token_of, weights.reshape(-1)[order]).to(x.dtype)


class MoE(nn.Module):
    """Routed experts (learned gate or hash table) plus the shared expert.

    Buffers: ``expert_bias`` (persistent, fp32; selection only, updated by
    :func:`update_expert_bias`) and ``tokens_per_expert`` (non-persistent fp32 counts of this
    step's routed tokens, accumulated under no_grad)."""

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor

    def __init__(self, config: DeepSeekV4Config, *, hash_routed: bool) -> None:
        super().__init__()
        c = config
        self.num_experts, self.top_k, self.hash_routed = (
            c.n_routed_experts,
            c.n_activated_experts,
            hash_routed,
        )
        self.gate: Router | HashRouter
        if hash_routed:
            self.gate = HashRouter(
                c.dim,
                c.vocab_size,
                c.n_routed_experts,
                c.n_activated_experts,
                c.route_scale,
                c.hash_seed,
            )
        else:
            self.gate = Router(c.dim, c.n_routed_experts, c.n_activated_experts, c.route_scale)
        self.experts = GroupedExperts(c.n_routed_experts, c.dim, c.moe_inter_dim, c.swiglu_limit)
        self.shared_experts = Expert(c.dim, c.n_shared_experts * c.moe_inter_dim, c.swiglu_limit)
        self.register_buffer("expert_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(c.n_routed_experts, dtype=torch.float32),
            persistent=False,
        )
        self.dispatch: Dispatch = local_dispatch

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, shard: SequenceShard | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, dim] -> (y [B, S, dim], sequence balance loss or None on hash layers; under
        context parallelism, ``shard``, this rank's share of the whole sequence's loss)."""
        batch, seq_len, dim = x.shape
        flat = x.reshape(-1, dim)
        if isinstance(self.gate, HashRouter):
            weights, indices, scores = self.gate(flat, token_ids)
        else:
            weights, indices, scores = self.gate(flat, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert += expert_counts(indices, self.num_experts).float()
        routed = self.dispatch(flat, indices, weights, self.experts)
        y = (routed + self.shared_experts(flat)).view(batch, seq_len, dim)
        if self.hash_routed:
            return y, None
        return y, balance_loss(
            scores.view(batch, seq_len, -1),
            indices.view(batch, seq_len, -1),
            self.num_experts,
            shard,
        )

    def reset_step_state(self) -> None:
        """Zero the step's counters (after a discarded step, or once the bias is updated)."""
        self.tokens_per_expert.zero_()

    def reset_parameters(self, std: float) -> None:
        self.gate.reset_parameters(std)
        self.experts.reset_parameters(std)
        self.shared_experts.reset_parameters(std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def balance_loss(
    scores: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """Sequence-wise balance loss ``sum_i f_i P_i`` averaged over sequences (unscaled):
    f_i = E / (K T) * #tokens routed to i, P_i = mean over tokens of the normalised scores.
    Under context parallelism (``shard``: the tokens are this rank's slice) the counts are the
    whole sequence's and the result is this rank's share: P_i is a sum over tokens."""
    batch, seq_len, top_k = indices.shape
    counts = torch.zeros(batch, num_experts, device=scores.device, dtype=torch.float32)
    counts.scatter_add_(
        1,
        indices.reshape(batch, -1),
        torch.ones_like(indices.reshape(batch, -1), dtype=torch.float32),
    )
    if shard is not None:
        counts, seq_len = shard.sum(counts), shard.length
    f = counts * (num_experts / (top_k * seq_len))
    p = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1) / seq_len
    return (f * p).sum(dim=-1).mean()


def update_expert_bias(
    model: nn.Module,
    rate: float,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Aux-loss-free balancing: ``bias += rate * sign(mean_load - load)`` on every learned-gate
    MoE, outside autograd, then reset every MoE's counters. ``reduce_counts`` receives the
    stacked [layers, experts] counts (e.g. an all-reduce across replicas so all apply the same
    update) and returns the counts to use."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    learned = [m for m in moes if not m.hash_routed]
    with torch.no_grad():
        if learned:
            counts = torch.stack([m.tokens_per_expert for m in learned])
            if reduce_counts is not None:
                counts = reduce_counts(counts)
            delta = torch.sign(counts.mean(dim=-1, keepdim=True) - counts) * rate
            for moe, row in zip(learned, delta, strict=True):
                moe.expert_bias += row.to(moe.expert_bias.device)
        for moe in moes:
            moe.reset_step_state()
