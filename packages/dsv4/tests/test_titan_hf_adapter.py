"""The torchtitan state-dict adapter: torchtitan's own checkpointer saves a DeepSeekV4LM in
transformers' layout (transformers loads it with our logits) and loads a folder transformers
wrote."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")
transformers = pytest.importorskip("transformers")

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager  # noqa: E402

from ttnpu.dsv4.titan import DeepSeekV4LM, DeepSeekV4StateDictAdapter, model_spec  # noqa: E402


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group, as the trainer runs (torch writes the shards' index only then)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _checkpointer(lm: DeepSeekV4LM, folder: Path) -> CheckpointManager:
    spec = model_spec("micro")
    assert spec.state_dict_adapter is DeepSeekV4StateDictAdapter
    config = CheckpointManager.Config(
        enable=True, folder=str(folder), last_save_in_hf=True, last_save_model_only=True
    )
    adapter = spec.state_dict_adapter(lm.config, None)
    return CheckpointManager(
        config, dataloader=None, model_parts=[lm], optimizers=None, lr_schedulers=None,
        states={}, sd_adapter=adapter,
    )  # fmt: skip


@pytest.mark.usefixtures("one_rank")
def test_torchtitan_saves_and_loads_transformers_layout(tmp_path: Path) -> None:
    lm = DeepSeekV4LM(model_spec("micro").model)
    with torch.no_grad():
        for moe in (m for m in lm.modules() if hasattr(m, "expert_bias")):
            moe.expert_bias.normal_(0, 0.1) if not moe.hash_routed else None
    checkpointer = _checkpointer(lm, tmp_path / "ckpt")
    saved = tmp_path / "saved"
    checkpointer.dcp_save(
        checkpointer.states["model"].state_dict(), str(saved), AsyncMode.DISABLED, to_hf=True
    )
    assert checkpointer.sd_adapter is not None
    (saved / "config.json").write_text(json.dumps(checkpointer.sd_adapter.hf_config()))
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        saved, dtype=torch.float32, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    tokens = torch.randint(0, lm.model.config.vocab_size, (2, 37))
    with torch.no_grad():
        ours, theirs = lm(tokens), hf.eval()(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)

    # and back: a folder transformers wrote (no MTP) into a fresh model
    hf.save_pretrained(tmp_path / "hf")
    fresh = DeepSeekV4LM(model_spec("micro").model)
    mtp_before = {k: v.clone() for k, v in fresh.state_dict().items() if ".mtp." in k}
    fresh_checkpointer = _checkpointer(fresh, tmp_path / "ckpt2")
    state = fresh_checkpointer.states["model"].state_dict()
    fresh_checkpointer.dcp_load(state, str(tmp_path / "hf"), from_hf=True, from_quantized=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), ours, atol=0, rtol=0)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in mtp_before.items())
