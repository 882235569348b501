"""Context parallelism, expert parallelism (all-to-all token dispatch over a device mesh) and
FSDP2 sharding; applied in that order.

CP: see :mod:`ttnpu.dsv4.context_parallel`; every rank of a CP group gets the same batch and
computes its slice of the sequences, its loss is its share of the group's, and FSDP over the
data x context ranks divides the summed gradients by the data-parallel size only.

EP: each rank keeps ``E / ep`` consecutive experts, as DTensors sharded on the expert dim over
the EP mesh (so checkpoints and grad-norm clipping see the whole expert tensors). A MoE layer
sorts its (token, expert) pairs by expert, exchanges counts, sends the rows to the experts'
owners (``all_to_all_single`` with autograd), runs its local experts through the grouped matmul,
and sends the results back. FSDP2 shards everything else; EP-sharded expert weights are left out
of FSDP and their gradients are divided by the EP size so every parameter sees the mean loss.

Both work on a model built on the meta device (only the local experts are allocated); its
``init_weights`` after ``to_empty`` gives every rank the shards of the unsharded init.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from .config import DeepSeekV4Config
from .context_parallel import ContextParallel, check_halo, compressor_halo, split
from .model import DeepSeekV4
from .moe import GroupedExperts, MoE, expert_counts

__all__ = [
    "ExpertParallelDispatch",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "check_context_parallel",
]


def apply_context_parallel(model: DeepSeekV4, mesh: DeviceMesh) -> None:
    """Split every sequence over the 1-D ``mesh``: each rank computes a contiguous slice of it.
    Apply it before expert parallelism and FSDP (they scale gradients by the CP size)."""
    if mesh.ndim != 1:
        raise ValueError(f"context parallelism needs a 1-D mesh, got {mesh.ndim}-D {mesh}")
    if model.context_parallel is not None:
        raise ValueError("context parallelism is already applied to this model")
    if any(isinstance(m, GroupedExperts) and isinstance(m.w1, DTensor) for m in model.modules()):
        raise ValueError("apply context parallelism before expert parallelism")
    model.context_parallel = ContextParallel(mesh.get_group())


def check_context_parallel(config: DeepSeekV4Config, seq_len: int, cp: int) -> None:
    """Refuse, before any training, a sequence length whose ``cp`` slices are too short for the
    halos the forward exchanges (the checks it would make at its first step)."""
    bounds = split(seq_len, cp)
    check_halo(bounds, config.window_size - 1, f"{config.window_size}-token sliding window")
    for ratio in sorted(set(config.compress_ratios) - {0}):
        rows = max(compressor_halo(start, ratio, config.is_csa(ratio)) for start, _ in bounds)
        check_halo(bounds, rows, f"compressed blocks of {ratio} tokens")


def _cp_size(model: DeepSeekV4) -> int:
    return 1 if model.context_parallel is None else model.context_parallel.size


class ExpertParallelDispatch:
    """The MoE dispatch for experts sharded over ``group`` (rank r owns experts
    ``[r * E/ep, (r + 1) * E/ep)``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        local_experts = experts.local_experts
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // indices.shape[1]
        counts = expert_counts(flat, local_experts * self.size)
        received, send_splits, recv_splits = self.exchange_counts(counts, local_experts)
        rows = x[token_of]
        inbox = _all_to_all(rows, recv_splits, send_splits, self.group)
        # Rows arrive grouped by (source, expert); the grouped matmul wants (expert, source).
        by_expert = _source_major_to_expert_major(received, sum(recv_splits))
        out = experts(inbox[by_expert], received.sum(0))
        back = torch.empty_like(out)
        back[by_expert] = out
        outbox = _all_to_all(back, send_splits, recv_splits, self.group)
        outbox = outbox * weights.reshape(-1)[order].unsqueeze(-1).to(outbox.dtype)
        outbox = outbox.to(x.dtype)
        # scatter_add_, not index_add_: autograd keeps index_add_'s source for its backward
        # (a [T x top_k, dim] copy per layer), scatter_add_'s only its index.
        at = token_of.unsqueeze(1).expand_as(outbox)
        return torch.zeros_like(x).scatter_add_(0, at, outbox)

    def exchange_counts(
        self, counts: torch.Tensor, local_experts: int
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """(received [ep, local_experts]: the rows rank s sends to this rank's local expert e,
        the rows this rank sends to each rank, the rows it receives from each) from this rank's
        ``counts`` per expert of the whole group: an all-to-all of the counts."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local_experts)
        send_splits = counts.view(self.size, local_experts).sum(1).tolist()
        return received, send_splits, received.sum(1).tolist()


def _all_to_all(
    rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of rows (its backward sends the gradients the other way)."""
    out = funcol.all_to_all_single_autograd(rows, recv, send, group)
    return funcol.wait_tensor(out)


def _source_major_to_expert_major(received: torch.Tensor, rows: int) -> torch.Tensor:
    """Permutation that reorders ``rows`` rows laid out [source][expert] (``received[s, e]``
    of each) into [expert][source]; on the counts' device, every shape known from ``rows``."""
    sources, experts = received.shape
    ends = received.flatten().cumsum(0)
    row = torch.arange(rows, device=received.device)
    segment = torch.searchsorted(ends, row, right=True)  # the (source, expert) of each row
    key = (segment % experts) * sources + segment // experts
    return torch.argsort(key, stable=True)


def apply_expert_parallel(model: DeepSeekV4, mesh: DeviceMesh) -> None:
    """Keep this rank's slice of every MoE's experts (as DTensors sharded over the 1-D ``mesh``)
    and switch its dispatch to all-to-all over the mesh's group.

    Works on a model on the meta device (then ``to_empty`` + ``init_weights``) or on identically
    initialised full models (same seed on every rank). The EP group must be the whole
    data-parallel group (EP = DP, or DP x CP under context parallelism): expert gradients,
    summed over ranks by the all-to-all backward, are divided by the data-parallel size to give
    the gradient of the mean loss, as FSDP does for the rest."""
    if mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D mesh, got {mesh.ndim}-D {mesh}")
    size, rank = mesh.size(), mesh.get_local_rank()
    dispatch = ExpertParallelDispatch(mesh.get_group())
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        if moe.num_experts % size:
            raise ValueError(f"{moe.num_experts} experts cannot be split over {size} EP ranks")
        if isinstance(moe.experts.w1, DTensor):
            raise ValueError("expert parallelism is already applied to this model")
    for moe in moes:
        per_rank = moe.num_experts // size
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name)
            local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        moe.experts.grad_scale = _cp_size(model) / size
        moe.dispatch = dispatch


def apply_fsdp(
    model: DeepSeekV4, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> None:
    """FSDP2 per block, per MTP block and at the root, with ``mp_policy`` (default: none).
    Expert weights already sharded by :func:`apply_expert_parallel` stay out of it; they get the
    policy's ``param_dtype`` as their compute dtype instead. Under context parallelism ``mesh``
    spans data x context ranks and gradients are divided by the data-parallel size only."""
    cp = _cp_size(model)
    if mesh.size() % cp:
        raise ValueError(f"the FSDP mesh of {mesh.size()} ranks is not data x {cp} CP ranks")
    policy = mp_policy or MixedPrecisionPolicy()
    ep_sharded = [
        m for m in model.modules() if isinstance(m, GroupedExperts) and isinstance(m.w1, DTensor)
    ]
    experts: set[nn.Parameter] = {p for m in ep_sharded for p in m.parameters()}
    for module in ep_sharded:
        module.param_dtype = policy.param_dtype
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=experts)
    for mtp in model.mtp:
        fully_shard(mtp, mesh=mesh, mp_policy=policy, ignored_params=experts)
        register_fsdp_forward_method(mtp, "predict")
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=experts)
    if cp > 1:
        for sharded in model.modules():
            if isinstance(sharded, FSDPModule):
                sharded.set_gradient_divide_factor(float(mesh.size() // cp))
                sharded.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    register_fsdp_forward_method(model, "loss")
    register_fsdp_forward_method(model, "losses")
