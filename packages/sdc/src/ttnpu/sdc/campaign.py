"""Detection campaign: inject bit flips, count per bit position what each detector caught.

``python -m ttnpu.sdc.campaign [--out campaign.json]`` prints one JSON document:

* ``matmul``: bf16 products of random shapes (each dim log-uniform up to ``--max-dim``, the product
  M·K·N capped by ``--max-macs`` to bound the run time) and value scales 1e-3..1e3; one random bit
  of one random output element flipped per trial. ``must_catch`` counts flips that change the
  element by at least the largest magnitude of its row (or make it NaN); all of them must be
  caught. ``--clean`` further clean products measure false alarms: ``raw_alarm_rate`` is the
  fraction whose checksum was suspect before recomputation (each one costs a recomputation),
  ``false_alarms`` the confirmed faults among them, which must be zero. Half of the clean products
  have same-signed operands (|N(0,1)|, as after an activation or a softmax), whose wide rows keep
  the output's rounding bias instead of averaging it out; the flipped products are zero-mean,
  where a change of the row's largest magnitude stands clear of the rounding noise.
* ``gradient``: a flip in one sampled gradient element of a small model after warm-up; caught when
  the detector reports that parameter at that step. ``must_catch``: flips that lift the statistic
  above the jump threshold (the detector's own rule, so this checks the implementation; most bit
  positions are invisible to a statistical detector by design).
* ``all_reduce``: bf16 and fp32 all-reduces over two gloo ranks (threads), a flip on rank 0's
  result; ``must_catch``: the change is at least the largest Σ_r|x_r| of its checksum chunk.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checksum import check_matmul
from .comm import CollectiveChecker, chunk_length
from .config import SDCConfig
from .events import Reporter, VetoFlag
from .gradient import GradientDetector
from .inject import flip_bit

__all__ = ["main", "run"]


class _Tally:
    """Per bit position: flips, caught, must_catch, must_caught."""

    def __init__(self, bits: int) -> None:
        self.rows = {
            b: {"flips": 0, "caught": 0, "must_catch": 0, "must_caught": 0} for b in range(bits)
        }

    def add(self, bit: int, caught: bool, must: bool) -> None:
        row = self.rows[bit]
        row["flips"] += 1
        row["caught"] += caught
        row["must_catch"] += must
        row["must_caught"] += must and caught

    def summary(self) -> dict[str, Any]:
        total = {
            k: sum(r[k] for r in self.rows.values())
            for k in ("flips", "caught", "must_catch", "must_caught")
        }
        return {
            **total,
            "must_missed": total["must_catch"] - total["must_caught"],
            "per_bit": self.rows,
        }


def _log_uniform(g: torch.Generator, low: float, high: float) -> float:
    return math.exp(float(torch.empty(1).uniform_(math.log(low), math.log(high), generator=g)))


def _shape(g: torch.Generator, max_dim: int, max_macs: int) -> tuple[int, int, int]:
    while True:
        m, k, n = (int(_log_uniform(g, 1, max_dim + 1)) for _ in range(3))
        if m * k * n <= max_macs:
            return m, k, n


def _operands(
    g: torch.Generator, max_dim: int, max_macs: int, same_signed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k, n = _shape(g, max_dim, max_macs)
    a = torch.randn(m, k, generator=g) * _log_uniform(g, 1e-3, 1e3)
    b = torch.randn(k, n, generator=g) * _log_uniform(g, 1e-3, 1e3)
    if same_signed:
        a, b = a.abs(), b.abs()
    return a.bfloat16(), b.bfloat16()


def matmul_campaign(
    trials: int, clean: int, max_dim: int, max_macs: int, seed: int
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    tally = _Tally(16)
    for _ in range(trials):
        a, b = _operands(g, max_dim, max_macs)
        out = a @ b
        index = int(torch.randint(out.numel(), (1,), generator=g))
        bit = int(torch.randint(16, (1,), generator=g))
        row_max = float(out[index // out.shape[1]].abs().max())
        delta = flip_bit(out, index, bit)
        r = check_matmul(a, b, out)
        tally.add(
            bit,
            r.verdict in ("transient", "persistent"),
            abs(delta) >= row_max or math.isnan(delta),
        )
    suspects = {"zero_mean": 0, "same_signed": 0}
    confirmed = 0
    ratios = []
    for i in range(clean):
        family = "same_signed" if i % 2 else "zero_mean"
        a, b = _operands(g, max_dim, max_macs, same_signed=i % 2 == 1)
        r = check_matmul(a, b, a @ b)
        suspects[family] += r.suspect
        confirmed += not r.ok
        ratios.append(r.magnitude)
    return {
        "dtype": "bfloat16",
        "max_dim": max_dim,
        "max_macs": max_macs,
        **tally.summary(),
        "clean_products": clean,
        "clean_suspect": sum(suspects.values()),
        "clean_suspect_by_operands": suspects,
        "raw_alarm_rate": sum(suspects.values()) / clean if clean else 0.0,
        "false_alarms": confirmed,
        "clean_worst_error_over_bound": max(ratios, default=0.0),
    }


def _tiny_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )


def gradient_campaign(trials: int, clean_steps: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    flag = VetoFlag()
    det = GradientDetector(
        model.named_parameters(),
        SDCConfig(grad_sample_interval=1),
        reporter=Reporter([flag]),
        accumulation_steps=1,
    )

    def backward() -> None:
        opt.zero_grad()
        x = torch.randn(16, 32, generator=g)
        model(x).pow(2).mean().backward()

    for _ in range(clean_steps):
        backward()
        det.after_backward()
        opt.step()
    false_alarms = len(flag.take())
    tally = _Tally(32)
    for _ in range(trials):
        backward()
        name, param = det.sampled[int(torch.randint(len(det.sampled), (1,), generator=g))]
        grad = param.grad
        assert grad is not None
        index = int(torch.randint(grad.numel(), (1,), generator=g))
        bit = int(torch.randint(32, (1,), generator=g))
        state = copy.deepcopy(det._history)
        hist = state[name]
        flip_bit(grad, index, bit)
        val = float(grad.abs().max()) ** 2
        thr1 = hist.avg * det.config.upper_thresh1 / (1.0 - 0.99**hist.normal)
        must = not math.isfinite(val) or (val > thr1 and abs(val - hist.pre_val) > thr1)
        det.check()
        caught = any(e.where == name for e in flag.take())
        det._history = state  # each trial starts from the same clean history
        tally.add(bit, caught, must)
    return {
        "dtype": "float32",
        "warmup_steps": clean_steps,
        "clean_false_alarms": false_alarms,
        **tally.summary(),
    }


def allreduce_campaign(trials: int, clean: int, max_numel: int, seed: int) -> dict[str, Any]:
    store = dist.HashStore()
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def rank_body(rank: int) -> None:
        try:
            group: Any = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))
            g = torch.Generator().manual_seed(seed + rank)
            shared = torch.Generator().manual_seed(seed)  # same sizes and scales on both ranks
            flips = torch.Generator().manual_seed(seed + 1)  # used by rank 0 only
            for dtype in (torch.bfloat16, torch.float32):
                bits = torch.finfo(dtype).bits
                tally = _Tally(bits)
                state: dict[str, Any] = {"bits": bits}

                def fault(op: str, result: torch.Tensor, state: dict[str, Any] = state) -> None:
                    if rank != 0 or not state.get("inject"):
                        return
                    index = int(torch.randint(result.numel(), (1,), generator=flips))
                    bit = int(torch.randint(state["bits"], (1,), generator=flips))
                    length = chunk_length(result.dtype, 2)
                    start = index // length * length
                    chunk_max = float(state["magnitude"][start : start + length].max())
                    delta = flip_bit(result, index, bit)
                    state["bit"], state["must"] = bit, abs(delta) >= chunk_max or math.isnan(delta)

                checker = CollectiveChecker(group, reporter=Reporter([]), fault=fault)
                false_alarms = 0
                for trial in range(trials + clean):
                    numel = int(_log_uniform(shared, 1, max_numel))
                    x = (torch.randn(numel, generator=g) * _log_uniform(shared, 1e-3, 1e3)).to(
                        dtype
                    )
                    magnitude = x.abs().float()
                    dist.all_reduce(magnitude, group=group)
                    state["magnitude"], state["inject"] = magnitude, trial < trials
                    ok = checker.all_reduce(x)
                    if rank == 0 and trial < trials:
                        tally.add(state["bit"], not ok, state["must"])
                    elif trial >= trials:
                        false_alarms += not ok
                if rank == 0:
                    out[str(dtype).removeprefix("torch.")] = {
                        "chunk_length": chunk_length(dtype, 2),
                        **tally.summary(),
                        "clean_collectives": clean,
                        "false_alarms": false_alarms,
                    }
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"world_size": 2, "backend": "gloo", **out}


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    result: dict[str, Any] = {
        "matmul": matmul_campaign(
            args.matmul_trials, args.clean, args.max_dim, args.max_macs, args.seed
        ),
        "gradient": gradient_campaign(args.grad_trials, args.warmup, args.seed),
        "all_reduce": allreduce_campaign(
            args.comm_trials, args.comm_clean, args.max_numel, args.seed
        ),
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["threads"] = torch.get_num_threads()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ttnpu.sdc.campaign", description=__doc__.split("\n")[0]
    )
    p.add_argument("--matmul-trials", type=int, default=4000)
    p.add_argument("--clean", type=int, default=10_000, help="clean products for false alarms")
    p.add_argument("--max-dim", type=int, default=4096)
    p.add_argument("--max-macs", type=int, default=2**24)
    p.add_argument("--grad-trials", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100, help="clean steps before gradient flips")
    p.add_argument("--comm-trials", type=int, default=2000)
    p.add_argument("--comm-clean", type=int, default=2000)
    p.add_argument("--max-numel", type=int, default=1 << 16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    missed = sum(result[k]["must_missed"] for k in ("matmul", "gradient"))
    missed += sum(v["must_missed"] for v in result["all_reduce"].values() if isinstance(v, dict))
    return 1 if missed or result["matmul"]["false_alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
