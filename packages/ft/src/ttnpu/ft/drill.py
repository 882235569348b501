"""A small replica training loop for fault drills, the multi-process tests and the benchmark.

    python -m ttnpu.ft.drill --replica-id 0 --lighthouse http://host:port --steps 20 --out DIR

Trains an MLP as one torchft replica group (``--mode ft``) or as one rank of a plain gloo
data-parallel job (``--mode plain``, the FT-off baseline). Writes one JSON line per step to
``DIR/replica_<id>.jsonl`` and, after every committed step, the model + optimizer + LR state to
``DIR/state_<id>_<step>.pt`` (atomically), so a test can compare replicas bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ttnpu.ft.replica import Replica, ReplicaConfig, StepResult


class TrainState:
    """Committed steps seen by this replica; carried over on heal (an example of an extra)."""

    def __init__(self) -> None:
        self.committed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"committed": self.committed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.committed = int(state_dict["committed"])


def build(width: int, depth: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    return model, optimizer, scheduler


class Batches:
    """Deterministic synthetic regression data, different per replica and per attempt."""

    def __init__(self, replica_id: int, batch: int, width: int, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed * 1000 + replica_id)
        self.batch, self.width = batch, width

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch, self.width, generator=self.generator)
        return x, x.sum(dim=1, keepdim=True).sin()


def save_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, lr: list[float]
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr": lr}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20, help="stop after this many committed steps")
    p.add_argument("--mode", choices=["ft", "plain"], default="ft")
    p.add_argument("--lighthouse", default=None)
    p.add_argument("--world-size", type=int, default=2, help="plain mode: number of ranks")
    p.add_argument("--master-port", type=int, default=0, help="plain mode: rendezvous port")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds added to each backward, before its last gradient is ready",
    )
    p.add_argument("--veto-at", type=int, nargs="*", default=[], help="steps this replica vetoes")
    p.add_argument(
        "--hold-at",
        type=int,
        default=None,
        help="at this step, inside the backward (before its last bucket and the vote), write "
        "DIR/holding_<id> and block until killed: a deterministic point for a kill drill (ft mode)",
    )
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--join-file", type=Path, default=None, help="wait for it before joining")
    p.add_argument("--go-file", type=Path, default=None, help="wait for it before training")
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"replica_{args.replica_id}.jsonl").open("a", buffering=1)
    model, optimizer, scheduler = build(args.width, args.depth, args.seed)
    batches = Batches(args.replica_id, args.batch, args.width, args.seed)
    loss_fn = nn.MSELoss()
    step = 0  # ft mode: the committed steps before the one in flight

    def inside_backward(grad: torch.Tensor) -> None:
        """Runs as the first layer's gradient is computed, the backward's last: before the
        all-reduce of its bucket and the ballot that ends the backward, so a replica stopped or
        held here has not yet contributed to the step."""
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step == args.hold_at:
            (args.out / f"holding_{args.replica_id}").write_text(str(step))
            while True:
                time.sleep(1)

    next(model.parameters()).register_hook(inside_backward)  # the first layer's weight

    def forward_backward() -> float:
        x, y = batches.next()
        loss = loss_fn(model(x), y)
        loss.backward()
        return float(loss.detach())

    def emit(record: dict[str, Any]) -> None:
        log.write(json.dumps({"t": time.time(), "replica": args.replica_id, **record}) + "\n")

    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    if args.mode == "plain":
        run_plain(args, model, optimizer, scheduler, forward_backward, emit, lambda: stop)
    else:
        train_state = TrainState()
        config = ReplicaConfig(
            replica_id=args.replica_id,
            lighthouse=args.lighthouse,
            collective_timeout=timedelta(seconds=args.collective_timeout),
            timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=30),
            device="cpu",
        )
        emit({"event": "imported", "pid": os.getpid()})
        wait_for(args.join_file)
        with Replica(
            config, model, optimizer, lr_scheduler=scheduler, extras={"train_state": train_state}
        ) as replica:
            emit({"event": "ready", "pid": os.getpid()})
            wait_for(args.go_file)
            veto_at = set(args.veto_at)
            while not stop and replica.manager.current_step() < args.steps:
                step = replica.manager.current_step()
                if step in veto_at:
                    veto_at.remove(step)  # once: the vetoed step is retried with new data
                    replica.veto.raise_flag(f"drill veto at step {step}")
                result = replica.run_step(forward_backward)
                if result.committed:
                    train_state.committed += 1
                emit_step(emit, result, replica.heals)
                if result.committed and not args.no_save:
                    path = args.out / f"state_{args.replica_id}_{result.step}.pt"
                    save_state(path, model, optimizer, scheduler.get_last_lr())
    emit({"event": "done"})
    log.close()


def wait_for(path: Path | None) -> None:
    """A start barrier: replicas heartbeat first, so the first quorum includes all of them."""
    while path is not None and not path.exists():
        time.sleep(0.05)


def emit_step(emit: Any, result: StepResult, heals: int) -> None:
    emit(
        {
            "step": result.step,
            "committed": result.committed,
            "vetoed": result.vetoed,
            "recovered": result.recovered,
            "participants": result.participants,
            "heals": heals,
            "loss": result.output,
            "seconds": result.seconds,
            "timings": result.timings,
        }
    )


def run_plain(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    forward_backward: Any,
    emit: Any,
    stopped: Any,
) -> None:
    """FT off: the same step with a plain gloo all-reduce of the flattened gradients."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://localhost:{args.master_port}",
        rank=args.replica_id,
        world_size=args.world_size,
    )
    emit({"event": "ready", "pid": os.getpid()})
    wait_for(args.go_file)
    try:
        for step in range(1, args.steps + 1):
            if stopped():
                break
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward()
            grads = [q.grad for q in model.parameters() if q.grad is not None]
            t1 = time.perf_counter()
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= args.world_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            allreduce_s = time.perf_counter() - t1
            optimizer.step()
            scheduler.step()
            seconds = time.perf_counter() - t0
            timings = {"timings": {"allreduce": allreduce_s}}
            emit({"step": step, "committed": True, "loss": loss, "seconds": seconds, **timings})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
