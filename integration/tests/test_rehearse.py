"""tools/rehearse.py: one training step of a recipe at full size, on fake tensors and the fake
process-group backend, checked on Flash's widths with 4 layers (window, CSA, HCA; hash and
learned MoE; MTP) over 8 ranks with CP 2 and EP 8: every collective the plan needs is issued with
its group, the memory per rank is the sharded size, the activations agree with the memory model,
and a plan that cannot run is refused with one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config

TOOL = Path(__file__).resolve().parents[2] / "tools" / "rehearse.py"
GIB = 2**30


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rehearse", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rehearse = _load_tool()


def _rehearse(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def flash_4_layers() -> dict[str, object]:
    done = _rehearse(
        "--config", "dsv4_flash", "--layers", "4", "--world-size", "8", "--cp", "2",
        "--seq-len", "4096", "--ac", "none", "--rank", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_every_rank_holds_its_shard_and_the_activations_the_model_predicts(
    flash_4_layers: dict[str, object],
) -> None:
    r = flash_4_layers
    assert (r["dp_shard"], r["cp"], r["ep"]) == (4, 2, 8)
    config = DeepSeekV4Config.from_flavor("flash").replace(
        n_layers=4, compress_ratios=(0, 0, 4, 128)
    )
    experts = 3 * config.n_routed_experts * config.moe_inter_dim * config.dim
    with torch.device("meta"):
        total = sum(p.numel() for p in DeepSeekV4(config).parameters())
    moe_layers = config.n_layers + config.n_mtp_layers
    others = total - moe_layers * experts
    # fp32 parameters: the others sharded by FSDP over the 8 ranks, the experts by EP over 8
    expected = 4 * (others / 8 + moe_layers * experts / 8)
    assert r["params_gib"] == pytest.approx(expected / GIB, rel=0.01)
    assert r["grads_gib"] == pytest.approx(r["params_gib"], rel=0.01)
    assert r["optimizer_gib"] == pytest.approx(2 * r["grads_gib"], rel=0.01)  # AdamW: 2 states
    predicted = r["predicted_activations_gib"]
    assert isinstance(predicted, float) and predicted > 0
    assert r["activations_gib"] == pytest.approx(predicted, rel=0.10)
    assert r["peak_gib"] >= r["params_gib"] + r["optimizer_gib"]


def test_the_plan_issues_its_collectives_on_their_groups(
    flash_4_layers: dict[str, object],
) -> None:
    calls = {(c["op"], c["group_size"]): c for c in flash_4_layers["collectives"]}  # type: ignore[union-attr]
    ops = {op for op, _ in calls}
    # FSDP2 over the 8 data x context ranks: parameters gathered, gradients reduce-scattered
    assert ("c10d._allgather_base_", 8) in calls and ("c10d._reduce_scatter_base_", 8) in calls
    # EP over 8: tokens to the experts' owners and back, forward and backward
    assert calls[("_c10d_functional.all_to_all_single", 8)]["calls"] >= 4 * 5
    # CP 2: the window and compressor halos point to point, the entries all-gathered
    assert ("c10d.send", 2) in calls or ("c10d.recv_", 2) in calls
    assert ("_c10d_functional.all_gather_into_tensor", 2) in calls
    assert not any(size not in (2, 8) for _, size in calls), ops


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "8", "--cp", "3"], "--cp 3 must divide --world-size 8"),
        (["--world-size", "8", "--cp", "8", "--seq-len", "512"], "sliding window"),
        (["--config", "dsv4_debug"], "pass --param-dtype bfloat16"),
        (["--config", "nope"], "unknown --config 'nope'"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the fake process group exists: in this process."""
    assert rehearse.main(["--layers", "2", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rehearse: error: "), lines
    assert message in lines[0] and not captured.out
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "8", "--ep", "4"], "ep must be 1 or dp_shard x cp"),
        (["--world-size", "12"], "256 experts cannot be split over 12 EP ranks"),
    ],
)
def test_a_plan_parallelize_refuses_is_refused_with_its_line(args: list[str], message: str) -> None:
    """Refused by the real ``parallelize``, on the fake process group: in a process of its
    own (torchtitan logs to the streams it was given when the group is built)."""
    done = _rehearse("--config", "dsv4_flash", "--layers", "2", *args)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("rehearse: ")]
    assert lines == [f"rehearse: error: {lines[0].removeprefix('rehearse: error: ')}"]
    assert message in lines[0] and not done.stdout
