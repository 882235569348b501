"""A bit flip in FSDP2's gradient reduce-scatter inside a replica group (two torchrun ranks): the
checked step's reduce-scatter catches it on every rank it hit, the step is vetoed on both ranks
and re-run, and the run then equals the clean one bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ttnpu.trainer.steplog import read_step_log

pytestmark = pytest.mark.e2e

RUN = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "4",
       "--parallelism.data_parallel_shard_degree", "2",
       "--sdc.checksums", "always", "--debug.deterministic", "--debug.seed", "0"]  # fmt: skip
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    "OMP_NUM_THREADS": "1",
}


def _start(folder: Path, name: str, *args: str) -> subprocess.Popen[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(port), "-m", "ttnpu.trainer.cli", "--device", "cpu",
           "--dump_folder", str(folder), "--run-name", name, *RUN, *args]  # fmt: skip
    return subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _records(run: Path) -> list[dict[str, Any]]:
    return read_step_log(run / "steps.jsonl")


def test_a_flip_in_the_fsdp_reduce_scatter_is_vetoed_and_the_rerun_equals_the_clean_run(
    tmp_path: Path,
) -> None:
    clean = _start(tmp_path, "clean")
    flipped = _start(tmp_path, "flip", "--sdc.inject_kind", "reduce_scatter",
                     "--sdc.inject_step", "2")  # fmt: skip
    for proc in (clean, flipped):
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]

    committed = {r["step"]: r["loss"] for r in _records(tmp_path / "clean") if "event" not in r}
    assert sorted(committed) == [1, 2, 3, 4]
    records = _records(tmp_path / "flip")
    [discarded] = [r for r in records if r.get("event") == "discarded"]
    assert (discarded["step"], discarded["vetoed"]) == (2, True)
    assert {r["step"]: r["loss"] for r in records if "event" not in r} == committed  # bitwise
    events = read_step_log(tmp_path / "flip" / "sdc_events.jsonl")
    assert events and all(
        (e["kind"], e["step"], e["confirmed"]) == ("collective", 2, True)
        and e["where"].startswith("reduce_scatter_tensor#")
        for e in events
    ), events
    assert {e["rank"] for e in events} == {0, 1}  # the flip hit both ranks' shards
    assert read_step_log(tmp_path / "clean" / "sdc_events.jsonl") == []
