"""Hugging Face checkpoints at scale: ``ttnpu.dsv4.load_weights`` streams a folder of either
layout into an FSDP + EP sharded model on 2 ranks; ``ttnpu-train`` starts from a folder
transformers wrote (``--checkpoint.initial_load_in_hf``) and exports its last step in
transformers' layout (``--checkpoint.last_save_in_hf``), which transformers loads with the
trained model's logits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, load_pretrained, load_weights, save_pretrained

pytestmark = pytest.mark.e2e


def _loaded_on_rank(rank: int, world: int, port: int, folders: list[str], out: str) -> None:
    """One rank: an EP + FSDP sharded model loads each folder; the sums of its full tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ttnpu.dsv4.parallel import apply_expert_parallel, apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    sums = []
    for folder in folders:
        model = DeepSeekV4(DeepSeekV4Config.from_flavor("micro"))
        apply_expert_parallel(model, mesh)
        apply_fsdp(model, mesh)
        load_weights(model, folder)
        sums.append({k: _sum(v) for k, v in model.state_dict().items()})
    Path(out).write_text(json.dumps(sums))
    dist.barrier()  # leave together, without the teardown (see test_dsv4_fsdp_ep.py)
    os._exit(0)


def _sum(tensor: torch.Tensor) -> float:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return float(full.double().sum())


def test_load_weights_streams_either_layout_into_a_sharded_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DeepSeekV4(DeepSeekV4Config.from_flavor("micro"))
    official = save_pretrained(model, tmp_path / "official")  # one tensor per expert
    folders = [str(official), str(save_pretrained(model, tmp_path / "hf", layout="hf"))]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                json.dumps([rank, 2, port, folders, str(tmp_path / f"{rank}.json")]),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    want = {k: _sum(v) for k, v in model.state_dict().items()}
    for rank in range(2):
        for got in json.loads((tmp_path / f"{rank}.json").read_text()):
            assert got.keys() == want.keys()
            assert all(got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-9) for k in want)


def test_ttnpu_train_loads_and_exports_transformers_checkpoints(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ttnpu.trainer.config_registry import CONFIGS

    model = CONFIGS["dsv4_debug"]().model_spec.model.dsv4()  # type: ignore[union-attr]
    hf_config = transformers.DeepseekV4Config(**model.to_hf_config())
    start = transformers.DeepseekV4ForCausalLM(hf_config)
    start.save_pretrained(tmp_path / "start")  # no MTP weights: the run keeps its own init
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ttnpu-train"), "--device", "cpu",
         "--training.steps", "1", "--checkpoint.interval", "100",
         "--checkpoint.initial_load_path", str(tmp_path / "start"),
         "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only",
         "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "has no MTP weights" in output
    saved = next((tmp_path / "runs").glob("*/checkpoint/step-1"))
    ours = load_pretrained(saved, source="hf")
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        saved, dtype=torch.float32, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    tokens = torch.randint(0, model.vocab_size, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf.eval()(tokens).logits, atol=2e-5, rtol=1e-4)
    # one AdamW step (lr 2e-3) from the loaded weights moves none of them by more than ~lr
    loaded = load_pretrained(tmp_path / "start").state_dict()
    moved = {
        k: (v - loaded[k]).abs().max().item() for k, v in ours.state_dict().items() if k in loaded
    }
    assert len(moved) > 100 and 0 < max(moved.values()) < 5e-3, moved


if __name__ == "__main__":
    _loaded_on_rank(*json.loads(sys.argv[1]))
