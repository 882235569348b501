"""Numerical parity with an independent implementation: transformers' DeepseekV4, loading our
official-format safetensors through its own key conversion."""

from pathlib import Path

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.checkpoint import save_pretrained

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("use_yarn", [False, True], ids=["plain-rope", "yarn"])
def test_logits_match_transformers_deepseek_v4(
    tiny: DeepSeekV4Config, tmp_path: Path, use_yarn: bool
) -> None:
    config = tiny.replace(use_yarn=use_yarn, rope_factor=4.0, original_seq_len=16, init_std=0.08)
    model = DeepSeekV4(config)
    with torch.no_grad():  # move every zero/one-initialised tensor off its trivial value
        for name, param in model.named_parameters():
            if name.endswith(("attn_sink", "ape", "_base", "_scale")) or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
        for moe in model.modules():
            if hasattr(moe, "expert_bias") and not moe.hash_routed:
                moe.expert_bias.normal_(0, 0.1)
    save_pretrained(model, tmp_path)
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert not info["unexpected_keys"]  # mtp.* is ignored by design: transformers has no MTP
    tokens = torch.randint(0, config.vocab_size, (2, 37))  # not a multiple of 4 or 8
    ours = model(tokens)
    with torch.no_grad():
        theirs = hf.eval()(tokens).logits
    assert ours.abs().max() > 0.5
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["debug", "flash"])
def test_reads_back_the_config_transformers_writes(name: str) -> None:
    ours = DeepSeekV4Config.from_flavor(name)
    theirs = transformers.DeepseekV4Config(**ours.to_hf_config()).to_dict()
    assert "layer_types" in theirs and "rope_parameters" in theirs
    assert DeepSeekV4Config.from_hf_config(theirs) == ours
