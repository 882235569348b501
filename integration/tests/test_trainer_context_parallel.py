"""``ttnpu-train`` with context parallelism: two ranks that each compute half of every sequence
(and hold half of the experts) train step for step like one process on the whole sequences."""

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

# 68 tokens: 34 per CP rank (>= the debug model's 31-token window halo), a CSA block straddles
# the border (34 = 8 x 4 + 2) and neither 68 nor 34 is a multiple of the HCA block (16).
RUN = ["--training.seq_len", "68", "--training.local_batch_size", "2", "--training.steps", "4",
       "--checkpoint.interval", "4"]  # fmt: skip
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    "OMP_NUM_THREADS": "1",
}


def _train(tmp_path: Path, name: str, ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    launch = [sys.executable]
    if ranks > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-port", str(port)]  # fmt: skip
    cmd = [*launch, "-m", "ttnpu.trainer.cli", "--dump_folder", str(tmp_path), "--run-name", name,
           *args]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)


def _steps(folder: Path) -> list[dict[str, Any]]:
    return [r for r in read_step_log(folder / "steps.jsonl") if "event" not in r]


def test_two_cp_ranks_with_experts_split_over_them_train_like_one_process(tmp_path: Path) -> None:
    one = _train(tmp_path, "one", 1, *RUN)
    assert one.returncode == 0, one.stderr[-3000:]
    cp = _train(tmp_path, "cp", 2, *RUN, "--parallelism.context_parallel_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1",
                "--parallelism.expert_parallel_degree", "2")  # fmt: skip
    assert cp.returncode == 0, cp.stderr[-3000:]
    split, whole = _steps(tmp_path / "cp"), _steps(tmp_path / "one")
    assert [r["step"] for r in split] == [r["step"] for r in whole] == [1, 2, 3, 4]
    for a, b in zip(split, whole, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert whole[-1]["loss"] < whole[0]["loss"]
