"""Anticipatory routing on a model sharded with FSDP2 over 2 gloo ranks trains like one process.

The capture forward is cut by an exception after the last router; FSDP2 would keep the root and
the last router's block unsharded and mid-forward. Each rank checks that every parameter is its
sharded DTensor again after every capture, and the schedule's losses and weights match an
unsharded run of the same schedule on the whole batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ttnpu.routing import AnticipatorySchedule, PeekableIterator, RouterSet, ScheduleConfig
from ttnpu.routing.testing import MarkovCorpus, TinyMoE

STEPS, BATCH = 7, 4
CONFIG = ScheduleConfig(delay_steps=2, active_steps=3)  # 3 ACTIVE, 2 DRAIN, 2 NORMAL steps


class _Rows(MarkovCorpus):
    """This rank's rows of every batch of the whole corpus."""

    def __init__(self, rows: slice) -> None:
        super().__init__(batch=BATCH, seq=17)
        self.rows = rows

    def batch_at(self, i: int) -> torch.Tensor:
        return super().batch_at(i)[self.rows]


def _train(
    model: TinyMoE,
    rows: slice,
    mean: Callable[[torch.Tensor], float],
    after_capture: Callable[[], None],
) -> list[tuple[str, int | None, float]]:
    """STEPS SGD steps of an AnticipatorySchedule triggered at step 0: (phase, lag, loss) each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # linear in the grads: comparable
    schedule = AnticipatorySchedule(
        RouterSet(model), PeekableIterator(_Rows(rows)), lambda b: model(b[:, :-1]), CONFIG
    )
    schedule.trigger()
    record = []
    for _ in range(STEPS):
        todo = schedule.next_step()
        after_capture()
        with todo.replay(0):
            loss = model.loss(todo.microbatches[0])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.finish_step()
        record.append((todo.phase.value, todo.lag, mean(loss.detach())))
    return record


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyMoE(dropout=0.0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def mean(loss: torch.Tensor) -> float:
        dist.all_reduce(loss)
        return float(loss) / world

    def all_sharded() -> None:
        if unsharded := [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]:
            raise AssertionError(f"unsharded after a capture: {unsharded}")

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    record = _train(model, rows, mean, all_sharded)
    weights = {n: p.full_tensor().sum().item() for n, p in model.named_parameters()}
    out.write_text(json.dumps({"record": record, "weights": weights}))
    dist.barrier()  # tear down together: gloo can abort a rank whose peer left first
    # The result is written: leave without the teardown, where a gloo thread still joinable at
    # exit aborts the process now and then (std::terminate, exit code -6).
    os._exit(0)


def test_capture_and_replay_under_fsdp2_on_two_ranks_match_one_process(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", str(port), str(tmp_path / f"{rank}.json")],
            env=env,
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    torch.manual_seed(0)
    reference = TinyMoE(dropout=0.0)
    expected = _train(reference, slice(None), float, lambda: None)
    phases = [(phase, lag) for phase, lag, _ in expected]
    assert phases == [("active", 0), ("active", 1), ("active", 2), ("drain", 2), ("drain", 2),
                      ("normal", None), ("normal", None)]  # fmt: skip
    assert ranks[0]["record"] == ranks[1]["record"]
    for (phase, lag, loss), (want_phase, want_lag, want_loss) in zip(
        ranks[0]["record"], expected, strict=True
    ):
        assert (phase, lag) == (want_phase, want_lag)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, total in ranks[0]["weights"].items():
        torch.testing.assert_close(
            total, reference.get_parameter(name).sum().item(), rtol=1e-4, atol=1e-4
        )


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
