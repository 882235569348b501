"""A heal of a model sharded unevenly over two gloo ranks (3 rows on 2 ranks: 2 + 1): the
restored optimizer state keeps the global shapes, and the next optimizer step runs and matches
the source's bit for bit."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ttnpu.ft import ReplicaState

WORLD = 2


def _sharded(mesh: DeviceMesh, seed: int, steps: int) -> ReplicaState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    for name, param in list(model.named_parameters()):
        setattr(
            model, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        _step(model, optimizer, mesh)
    return ReplicaState(model, optimizer)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
    inputs = distribute_tensor(torch.ones(2, 4), mesh, [Replicate()])
    model(inputs).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=WORLD
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        source, target = _sharded(mesh, 0, steps=2), _sharded(mesh, 1, steps=0)
        assert source.model.weight.to_local().shape[0] == (2, 1)[rank]  # uneven shards
        target.restore(source.snapshot())
        for param in target.model.parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                state = target.optimizer.state[param][moment]
                assert isinstance(state, DTensor) and state.shape == param.shape, moment
        _step(source.model, source.optimizer, mesh)
        _step(target.model, target.optimizer, mesh)
        for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
            assert torch.equal(a.to_local(), b.to_local())
        dist.barrier()  # gloo aborts at exit when a peer tears down mid-collective
    finally:
        dist.destroy_process_group()


def test_a_heal_of_uneven_shards_keeps_global_shapes_and_trains_on() -> None:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output[-3000:]


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]))
