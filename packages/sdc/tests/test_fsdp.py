"""FSDP2's gradient reduce-scatter through CheckedReduceScatter on 2 gloo processes: the same
gradients as FSDP2's own comm, a flip in one rank's shard reported there; unchecked calls are
plain, and a flip in one of them goes through unseen.

Each rank runs this file as a script (FSDP2 needs a real process group); the test compares what
they write.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn


def _worker(rank: int, world: int, port: int, out: Path, reduction: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ttnpu.sdc import (
        CheckedReduceScatter,
        Reporter,
        VetoFlag,
        check_fsdp_reduce_scatter,
        flip_bit,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if reduction == "sum":  # as ttnpu-trainer shards DeepSeek-V4 (gloo has no PREMUL_SUM)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

    def grads() -> list[list[float]]:
        model.zero_grad()
        model(x).square().mean().backward()
        return [p.grad.to_local().flatten().tolist() for p in model.parameters()]

    plain = grads()  # FSDP2's own reduce-scatter
    flag = VetoFlag()
    state = {"checking": True, "flip_at": 0, "calls": 0}

    def fault(op: str, result: torch.Tensor) -> None:
        state["calls"] += 1
        if rank == 1 and state["calls"] == state["flip_at"]:
            flip_bit(result, 3, 30)

    comm = CheckedReduceScatter(
        checking=lambda: bool(state["checking"]),
        reporter=Reporter([flag], rank=rank),
        fault=fault,
    )
    modules = check_fsdp_reduce_scatter(model, comm)
    checked = grads()
    clean_events, checks_clean = len(flag.take()), comm.checks
    state["flip_at"] = state["calls"] + 2  # the second reduce-scatter of the next backward
    grads()
    flipped = [(e.kind, e.where, e.confirmed) for e in flag.take()]
    state["checking"] = False
    before = comm.checks
    unchecked = grads()
    state["flip_at"] = state["calls"] + 1  # unchecked: the flip goes through unseen
    silent = grads() != unchecked and not flag.take()
    out.write_text(
        json.dumps(
            {
                "modules": modules,
                "checked_equals_plain": checked == plain,
                "unchecked_equals_plain": unchecked == plain,
                "clean_events": clean_events,
                "checks_clean": checks_clean,
                "flipped": flipped,
                "failures": comm.failures,
                "checks_while_off": comm.checks - before,
                "unchecked_flip_silent": silent,
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path: Path, reduction: str) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"{reduction}{rank}.json" for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", str(port), str(out), reduction], env=env
        )
        for rank, out in enumerate(outs)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return [json.loads(out.read_text()) for out in outs]


def test_fsdp2_reduce_scatter_is_verified_and_a_flip_is_caught_on_its_rank(
    tmp_path: Path,
) -> None:
    for reduction in ("avg", "sum"):  # FSDP2's default op; the trainer's plain SUM
        ranks = _run(tmp_path, reduction)
        for rank, got in enumerate(ranks):
            assert got["modules"] == 3
            assert got["checked_equals_plain"] and got["unchecked_equals_plain"], reduction
            assert got["clean_events"] == 0 and got["checks_clean"] == 2  # the root holds no params
            assert got["checks_while_off"] == 0
            assert got["unchecked_flip_silent"] == (rank == 1)
            if rank == 1:
                assert got["failures"] == 1
                [(kind, where, confirmed)] = got["flipped"]
                assert kind == "collective" and confirmed
                assert where == "reduce_scatter_tensor#4", where  # the 2nd of the 2nd backward
            else:
                assert got["failures"] == 0 and got["flipped"] == []


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
