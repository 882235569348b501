"""One rank of the benchmark: three data-parallel arms of the same model in one process.

    python -m ttnpu.ft.bench_arms --replica-id 0 --out DIR --master-port P \
        --lighthouse URL --torchft-lighthouse URL [--width 1024 --depth 4 --batch 256]

Arms take turns step by step (off, ft, torchft, off, ...; a barrier before each), so a change
in the host's load hits all three alike: ``off`` plain gloo data parallelism (the gradients
flattened, all-reduced, copied back); ``ft`` ttnpu.ft's ``Replica``; ``torchft`` torchft's own
``DistributedDataParallel`` + ``OptimizerWrapper`` over a Manager. Each arm trains its own copy
of the model; one JSON line per step goes to ``DIR/arms_<id>.jsonl`` with wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from ttnpu.ft.drill import Batches, build, wait_for
from ttnpu.ft.replica import Replica, ReplicaConfig

ARMS = ("off", "ft", "torchft")
TIMEOUT = timedelta(seconds=60)


def _plain_arm(args: argparse.Namespace) -> Callable[[Callable[[nn.Module], None]], dict[str, Any]]:
    model, optimizer, scheduler = build(args.width, args.depth, args.seed)
    world = dist.get_world_size()

    def step(forward_backward: Callable[[nn.Module], None]) -> dict[str, Any]:
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()
        scheduler.step()
        return {}

    return step


def _ft_arm(args: argparse.Namespace) -> tuple[Replica, Callable[..., dict[str, Any]]]:
    model, optimizer, scheduler = build(args.width, args.depth, args.seed)
    config = ReplicaConfig(
        replica_id=args.replica_id,
        lighthouse=args.lighthouse,
        device="cpu",
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    replica = Replica(config, model, optimizer, lr_scheduler=scheduler)

    def step(forward_backward: Callable[[nn.Module], None]) -> dict[str, Any]:
        result = replica.run_step(lambda: forward_backward(model))
        assert result.committed, "bench: an ft step was not committed"
        return {"timings": result.timings}

    return replica, step


def _torchft_arm(
    args: argparse.Namespace, store: TCPStore
) -> tuple[Manager, Callable[..., dict[str, Any]]]:
    model, optimizer, scheduler = build(args.width, args.depth, args.seed)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=args.torchft_lighthouse,
        replica_id=f"torchft_{args.replica_id}",
    )
    ddp = DistributedDataParallel(manager, model)
    wrapped = OptimizerWrapper(manager, optimizer)
    calls = ("start_quorum", "wait_quorum", "should_commit")
    spent = {name: _timed(manager, name) for name in calls}

    def step(forward_backward: Callable[[nn.Module], None]) -> dict[str, Any]:
        for seconds in spent.values():
            seconds[0] = 0.0
        wrapped.zero_grad(set_to_none=True)
        forward_backward(ddp)
        before = manager.current_step()
        wrapped.step()
        assert manager.current_step() == before + 1, "bench: a torchft step was not committed"
        scheduler.step()
        quorum = spent["start_quorum"][0] + spent["wait_quorum"][0]
        return {"timings": {"quorum": quorum, "vote": 0.0, "commit": spent["should_commit"][0]}}

    return manager, step


def _timed(manager: Manager, name: str) -> list[float]:
    """Time the Manager's ``name`` (the seconds spent in it this step, summed): torchft's calls
    that ttnpu.ft's step times as its quorum and commit, so both arms' own calls compare."""
    call, seconds = getattr(manager, name), [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - t0

    setattr(manager, name, timed)
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--torchft-lighthouse", required=True)
    p.add_argument("--go-file", type=Path, default=None, help="wait for it before training")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps per arm per round")
    p.add_argument("--warmup", type=int, default=3, help="steps per arm before the rounds")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    dist.init_process_group(
        "gloo", init_method=f"tcp://localhost:{args.master_port}", rank=args.replica_id,
        world_size=2,
    )  # fmt: skip
    replica, ft_step = _ft_arm(args)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # torchft's group
    manager, torchft_step = _torchft_arm(args, store)
    steps = {"off": _plain_arm(args), "ft": ft_step, "torchft": torchft_step}
    batches = Batches(args.replica_id, args.batch, args.width, args.seed)
    loss_fn = nn.MSELoss()

    def forward_backward(model: nn.Module) -> None:
        x, y = batches.next()
        loss_fn(model(x), y).backward()

    log = (args.out / f"arms_{args.replica_id}.jsonl").open("a", buffering=1)
    log.write(json.dumps({"event": "ready"}) + "\n")
    wait_for(args.go_file)
    try:
        for round_ in range(-1, args.rounds):  # round -1: warm-up, not reported
            for _ in range(args.warmup if round_ < 0 else args.steps):
                for arm in ARMS:
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    extra = steps[arm](forward_backward)
                    record = {
                        "arm": arm, "round": round_, "rank": args.replica_id,
                        "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                        **extra,
                    }  # fmt: skip
                    log.write(json.dumps(record) + "\n")
        log.write(json.dumps({"event": "done"}) + "\n")
    finally:
        replica.close()
        manager.shutdown(wait=False)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
