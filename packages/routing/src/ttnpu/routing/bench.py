"""Benchmark: the cost of anticipatory routing on a small MoE, as ratios measured side by side.

``python -m ttnpu.routing.bench [--device cpu] [--rounds 30]`` prints one JSON line:
``active_over_normal_step`` (an ACTIVE training step, capture + replay + checks, over a NORMAL
one), ``capture_over_nograd_forward`` (capturing one micro-batch over a bare no-grad forward with
head and loss) and ``capture_over_train_step``. Rounds interleave all four measurements so that
load on the machine hits them alike; figures are ratios of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ttnpu.routing.data import PeekableIterator
from ttnpu.routing.routers import RouterSet
from ttnpu.routing.schedule import AnticipatorySchedule, ScheduleConfig
from ttnpu.routing.testing import MarkovCorpus, TinyMoE


class _Pool:
    """Pre-made batches, cycled, with a position (so data loading is not what is measured)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches, self.index = batches, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.index += 1
            yield self.batches[(self.index - 1) % len(self.batches)]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    return accelerator or torch.device("cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m ttnpu.routing.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default=None, help="default: the accelerator if any, else cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--delay-steps", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    device = _device(args.device)

    torch.manual_seed(0)
    model = TinyMoE(args.vocab, args.dim, args.layers, args.experts, args.top_k, 2 * args.dim, 0.0)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = MarkovCorpus(batch=args.batch, seq=args.seq + 1, vocab=args.vocab)
    pool = [corpus.batch_at(i).to(device) for i in range(16)]
    routers = RouterSet(model)

    def schedule() -> AnticipatorySchedule[torch.Tensor]:
        config = ScheduleConfig(delay_steps=args.delay_steps, active_steps=10**9)
        return AnticipatorySchedule(routers, PeekableIterator(_Pool(pool)), model.loss, config)

    normal, active = schedule(), schedule()
    active.trigger()
    active.warm_up()

    def train(s: AnticipatorySchedule[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            todo = s.next_step()
            with todo.replay(0):
                model.loss(todo.microbatches[0]).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.update_router_biases()
            s.finish_step()

        return run

    def nograd_forward() -> None:
        with torch.no_grad():
            model.loss(pool[0])

    probes: dict[str, Callable[[], object]] = {
        "normal_step": train(normal),
        "active_step": train(active),
        "capture": lambda: routers.capture(lambda: model.loss(pool[0])),
        "nograd_forward": nograd_forward,
    }
    times: dict[str, list[float]] = {name: [] for name in probes}
    for r in range(args.rounds + 3):  # three warm-up rounds, not recorded
        for name, probe in probes.items():
            _sync(device)
            start = time.perf_counter()
            probe()
            _sync(device)
            if r >= 3:
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    train_step = med["normal_step"]
    result = {
        "bench": "ttnpu.routing",
        "device": str(device),
        "model": {k: getattr(args, k) for k in ("dim", "layers", "experts", "top_k", "vocab")},
        "tokens_per_step": args.batch * args.seq,
        "delay_steps": args.delay_steps,
        "rounds": args.rounds,
        "active_over_normal_step": round(med["active_step"] / train_step, 4),
        "capture_over_nograd_forward": round(med["capture"] / med["nograd_forward"], 4),
        "capture_over_train_step": round(med["capture"] / train_step, 4),
        "normal_step_ms": round(1e3 * train_step, 3),
        "goal_active_over_normal_step": 1.15,
    }
    print(json.dumps(result))
    return result


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


if __name__ == "__main__":
    main()
