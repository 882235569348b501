"""``ttnpu-train`` starts from a folder transformers wrote (``--checkpoint.initial_load_in_hf``)
and exports its last step in transformers' layout (``--checkpoint.last_save_in_hf``), which
transformers loads with the trained model's logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttnpu.dsv4 import load_pretrained
from ttnpu.trainer.config_registry import CONFIGS

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e


def test_ttnpu_train_loads_and_exports_transformers_checkpoints(tmp_path: Path) -> None:
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
