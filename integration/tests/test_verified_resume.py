"""Verified loads end to end: a real ``ttnpu-train`` resume falls back past a corrupt and an
unverified checkpoint and says so, and two real ranks split the hashing and agree on a verdict."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ttnpu.trainer.run_folder import CHECKSUMS

pytestmark = pytest.mark.e2e

ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
       "OMP_NUM_THREADS": "1"}  # fmt: skip
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


def _train(run: Path, *args: str) -> tuple[str, dict[int, float]]:
    cmd = [sys.executable, "-m", "ttnpu.trainer.cli", "--device", "cpu", *args]
    done = subprocess.run(cmd, cwd=run, env=ENV, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, {int(m.group(1)): float(m.group(2)) for m in _STEP.finditer(output)}


def _flip_a_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_resume_skips_a_corrupt_and_an_unverified_checkpoint_and_says_so(tmp_path: Path) -> None:
    """Three steps, a checkpoint after each (asynchronous saves: sealed when known finished). A
    flipped bit in step 3 and step 2's manifest deleted: the resume starts from step 1, names
    both, and trains steps 2 and 3 as the straight run did."""
    _, straight = _train(tmp_path, "--run-name", "run", "--training.steps", "3",
                         "--checkpoint.interval", "1", "--checkpoint.async_mode", "async",
                         "--checkpoint.keep_latest_k", "0", "--training.seq_len", "64",
                         "--training.local_batch_size", "2")  # fmt: skip
    checkpoints = tmp_path / "runs" / "run" / "checkpoint"
    assert {p.parent.name for p in checkpoints.glob(f"*/{CHECKSUMS}")} == {
        "step-1",
        "step-2",
        "step-3",
    }
    _flip_a_bit(checkpoints / "step-3" / "__0_0.distcp")
    (checkpoints / "step-2" / CHECKSUMS).unlink()

    output, resumed = _train(tmp_path, "--resume", "runs/run")
    assert (
        "checkpoint runs/run/checkpoint/step-3 skipped: file __0_0.distcp does not match its "
        "SHA-256 (corrupt)" in output
    )
    assert (
        f"checkpoint runs/run/checkpoint/step-2 skipped: unverified (no {CHECKSUMS}; "
        "--checkpoint.allow_unverified accepts it)" in output
    )
    assert "resuming from step 1: runs/run/checkpoint/step-1 verifies" in output
    assert "Training starts at step 2" in output
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4), (straight, resumed)


_RANK = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ttnpu.trainer.run_folder import _local_reason, unverified_reason, write_checksums

    folder, rank = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    path = folder / "step-1"
    dcp.save({f"w{rank}": torch.full((4096,), float(rank))}, checkpoint_id=str(path))
    write_checksums(path)
    assert unverified_reason(path) is None
    dist.barrier()
    if rank == 0:
        data = path / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    dist.barrier()
    print(f"local: {_local_reason(path, False, rank, 2)}")
    print(f"agreed: {unverified_reason(path)}")
    dist.barrier()
    dist.destroy_process_group()
""")


def test_two_ranks_hash_their_own_shares_and_agree(tmp_path: Path) -> None:
    """Sorted names ``.metadata``, ``__0_0.distcp``, ``__1_0.distcp``: rank 1 hashes
    ``__0_0.distcp``, so only rank 1 sees its flipped bit, and both ranks report it."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    cmd = [sys.executable, str(script), str(tmp_path)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    ranks = [subprocess.Popen([*cmd, str(rank)], env=ENV, **pipes) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    corrupt = "file __0_0.distcp does not match its SHA-256 (corrupt)"
    assert "local: None" in outputs[0] and f"local: {corrupt}" in outputs[1]
    assert all(f"agreed: {corrupt}" in output for output in outputs)
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", CHECKSUMS
    ]  # fmt: skip
