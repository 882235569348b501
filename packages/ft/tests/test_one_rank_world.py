"""What needs a torch.distributed world (one gloo rank): DTensor restores, FSDP2 cleanup."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ttnpu.ft import ReplicaState, RestoreError, clean_training_site, weights_fingerprint


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_state(mesh: object, seed: int, steps: int) -> ReplicaState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    for name, param in list(model.named_parameters()):
        placement = [Shard(0)] if name == "weight" else [Replicate()]
        dparam = torch.nn.Parameter(distribute_tensor(param.detach(), mesh, placement))  # type: ignore[arg-type]
        setattr(model, name, dparam)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(distribute_tensor(torch.randn(2, 4), mesh, [Replicate()])).sum().backward()  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad()
    return ReplicaState(model, opt)


def test_dtensor_roundtrip_keeps_placement_and_values(mesh: object) -> None:
    source, target = sharded_state(mesh, 0, steps=2), sharded_state(mesh, 1, steps=0)
    target.restore(source.snapshot())
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert isinstance(b, DTensor) and a.placements == b.placements
        assert torch.equal(a.to_local(), b.to_local())
    moments = target.optimizer.state[target.model.weight]["exp_avg"]
    assert isinstance(moments, DTensor) and moments.placements == (Shard(0),)


def test_a_dtensor_is_fingerprinted_by_its_local_shard(mesh: object) -> None:
    params = list(sharded_state(mesh, 0, steps=1).model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    local = [p.to_local() for p in params]  # type: ignore[attr-defined]
    assert torch.equal(weights_fingerprint(params), weights_fingerprint(local))


def test_dtensor_placement_mismatch_is_refused(mesh: object) -> None:
    source, target = sharded_state(mesh, 0, steps=1), sharded_state(mesh, 1, steps=1)
    before = target.model.weight.to_local().clone()
    snap = source.snapshot()
    snap["model"]["weight"]["placements"] = [str(Replicate())]
    expected = r"model\.weight: placement \['R'\] != live \['S\(0\)'\]"
    with pytest.raises(RestoreError, match=expected):
        target.restore(snap)
    assert torch.equal(target.model.weight.to_local(), before)


def test_fsdp_root_is_found_and_reset_after_an_interrupted_backward(mesh: object) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fully_shard(model[0], mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]

    def stop(*_: object) -> None:
        raise RuntimeError("FORCE STOP")  # what a stopped device raises mid-backward

    hook = model[0].register_full_backward_hook(stop)
    with pytest.raises(RuntimeError, match="FORCE STOP"):
        model(torch.randn(3, 4)).sum().backward()
    hook.remove()
    report = clean_training_site(model)
    assert report.fsdp_roots_reset == 1  # the root only, not the inner fully_shard module
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(3, 4)).sum().backward()  # the next step runs normally
    assert all(p.grad is not None for p in model.parameters())
