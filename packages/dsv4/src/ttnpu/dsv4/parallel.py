"""Expert parallelism (all-to-all token dispatch over a process group) and FSDP2 sharding.

EP: each rank keeps ``E / ep`` consecutive experts. A MoE layer sorts its (token, expert) pairs by
expert, exchanges counts, sends the rows to the experts' owners (``all_to_all_single`` with
autograd), runs its local experts through the grouped matmul, and sends the results back. FSDP2
shards everything else; expert weights are left out of FSDP (they already differ per rank) and
their gradients are divided by the data-parallel size so every parameter sees the mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from .model import DeepSeekV4
from .moe import GroupedExperts, MoE

__all__ = ["ExpertParallelDispatch", "apply_expert_parallel", "apply_fsdp"]


class ExpertParallelDispatch:
    """The MoE dispatch for experts sharded over ``group`` (rank r owns experts
    ``[r * E/ep, (r + 1) * E/ep)``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        local_experts = experts.w1.shape[0]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // indices.shape[1]
        counts = torch.bincount(flat, minlength=local_experts * self.size)
        # received[s, e]: rows that rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local_experts)
        send_splits = counts.view(self.size, local_experts).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        rows = x[token_of]
        inbox = _all_to_all(rows, recv_splits, send_splits, self.group)
        # Rows arrive grouped by (source, expert); the grouped matmul wants (expert, source).
        by_expert = _source_major_to_expert_major(received)
        out = experts(inbox[by_expert], received.sum(0))
        back = torch.empty_like(out)
        back[by_expert] = out
        outbox = _all_to_all(back, send_splits, recv_splits, self.group)
        outbox = outbox * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, outbox)


def _all_to_all(
    rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of rows (its backward sends the gradients the other way)."""
    out = funcol.all_to_all_single_autograd(rows, recv, send, group)
    return funcol.wait_tensor(out)


def _source_major_to_expert_major(received: torch.Tensor) -> torch.Tensor:
    """Permutation that reorders rows laid out [source][expert] into [expert][source]."""
    sources, experts = received.shape
    segment = torch.repeat_interleave(torch.arange(sources * experts), received.flatten().cpu())
    key = (segment % experts) * sources + segment // experts
    return torch.argsort(key, stable=True).to(received.device)


def apply_expert_parallel(model: DeepSeekV4, group: dist.ProcessGroup) -> None:
    """Keep this rank's slice of every MoE's experts and switch its dispatch to all-to-all.

    Call on identically initialised full models (same seed on every rank). ``group`` is the whole
    data-parallel group (EP = DP): expert gradients, summed over ranks by the all-to-all backward,
    are divided by its size to give the gradient of the mean loss, as FSDP does for the rest."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dispatch = ExpertParallelDispatch(group)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if module.num_experts % size:
            raise ValueError(f"{module.num_experts} experts cannot be split over {size} EP ranks")
        per_rank = module.num_experts // size
        experts = module.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            setattr(experts, name, nn.Parameter(local))
            getattr(experts, name).register_hook(lambda grad: grad / size)
        module.dispatch = dispatch


def apply_fsdp(model: DeepSeekV4, mesh: DeviceMesh) -> None:
    """FSDP2 per block and at the root; expert weights (EP-sharded already) stay out of it."""
    experts = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    for block in model.layers:
        fully_shard(block, mesh=mesh, ignored_params=experts)
    for mtp in model.mtp:
        fully_shard(mtp, mesh=mesh, ignored_params=experts)
        register_fsdp_forward_method(mtp, "predict")
    fully_shard(model, mesh=mesh, ignored_params=experts)
    register_fsdp_forward_method(model, "loss")
    register_fsdp_forward_method(model, "losses")
