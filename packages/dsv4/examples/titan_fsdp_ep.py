"""DeepSeek-V4 (debug) sharded by its torchtitan ``parallelize_fn``: FSDP2 and expert parallelism
over 2 ranks, initialised as one process would be, then one training step.

    uv run torchrun --standalone --nproc_per_node 2 packages/dsv4/examples/titan_fsdp_ep.py
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.spmd_types import annotate_input_spmd_types
from torchtitan.distributed.utils import get_spmd_context

from ttnpu.dsv4.titan import model_spec

if torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator()
    torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
else:  # torchtitan 0.3 assumes cuda when there is no accelerator: its meshes go on cpu here
    import torchtitan.distributed.parallel_dims

    torchtitan.distributed.parallel_dims.device_type = "cpu"
    device = torch.device("cpu")
dist.init_process_group()  # rank and world size from torchrun's environment
rank, world = dist.get_rank(), dist.get_world_size()

spec = model_spec("debug")
dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world)
with torch.device("meta"):
    model = spec.model.build()
training = TrainingConfig(mixed_precision_param="float32")
model = spec.parallelize_fn(model, parallel_dims=dims, training=training)
model.to_empty(device=device)
torch.manual_seed(0)  # the same on every rank (torchtitan's set_determinism does this)
with torch.no_grad():
    model.init_weights()

experts = model.model.layers[0].ffn.experts.w1
print(f"rank {rank}: routed experts w1 {tuple(experts.to_local().shape)} of {tuple(experts.shape)}")
tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(rank))
tokens = tokens.to(device)
labels = torch.roll(tokens, -1, 1)
tokens, labels, _ = annotate_input_spmd_types(dims, tokens, labels, {})
with get_spmd_context(parallel_dims=dims)():  # torchtitan's Trainer runs its step in this
    loss = model(tokens, labels=labels) / world  # gradients are summed over the ranks
    loss.backward()
loss = loss.detach()
dist.all_reduce(loss)
params = list(model.parameters())
sharded = sum(isinstance(p, DTensor) for p in params)
if rank == 0:
    print(
        f"loss {loss.item():.3f} over {world} ranks; {sharded} of {len(params)} parameters sharded"
    )
dist.destroy_process_group()
