import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config
from ttnpu.dsv4.checkpoint import (
    CheckpointError,
    from_official,
    load_official_state_dict,
    load_pretrained,
    save_pretrained,
    to_official,
)


def _trained_like(config: DeepSeekV4Config) -> DeepSeekV4:
    model = DeepSeekV4(config)
    with torch.no_grad():
        for moe in (m for m in model.modules() if hasattr(m, "expert_bias")):
            if not moe.hash_routed:
                moe.expert_bias.normal_()
    return model


def test_official_keys_and_shapes_for_flash() -> None:
    with torch.device("meta"):
        state = to_official(DeepSeekV4(DeepSeekV4Config.from_flavor("flash")).state_dict())
    shapes = {k: list(v.shape) for k, v in state.items()}
    expected = {
        "embed.weight": [129280, 4096],
        "head.weight": [129280, 4096],
        "hc_head_fn": [4, 16384],
        "layers.0.attn.wq_a.weight": [1024, 4096],
        "layers.0.attn.wq_b.weight": [32768, 1024],
        "layers.0.attn.wkv.weight": [512, 4096],
        "layers.0.attn.wo_a.weight": [8192, 4096],
        "layers.0.attn.wo_b.weight": [4096, 8192],
        "layers.0.attn.attn_sink": [64],
        "layers.0.ffn.gate.tid2eid": [129280, 6],
        "layers.0.hc_attn_fn": [24, 16384],
        "layers.0.hc_ffn_scale": [3],
        "layers.2.attn.compressor.wkv.weight": [1024, 4096],
        "layers.2.attn.compressor.ape": [4, 1024],
        "layers.2.attn.indexer.wq_b.weight": [8192, 1024],
        "layers.2.attn.indexer.weights_proj.weight": [64, 4096],
        "layers.2.attn.indexer.compressor.wgate.weight": [256, 4096],
        "layers.2.attn.indexer.compressor.ape": [4, 256],
        "layers.2.attn.indexer.compressor.norm.weight": [128],
        "layers.3.attn.compressor.ape": [128, 512],
        "layers.3.ffn.gate.bias": [256],
        "layers.3.ffn.experts.255.w1.weight": [2048, 4096],
        "layers.3.ffn.experts.0.w2.weight": [4096, 2048],
        "layers.3.ffn.shared_experts.w3.weight": [2048, 4096],
        "mtp.0.e_proj.weight": [4096, 4096],
        "mtp.0.hc_head_base": [4],
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert "layers.0.ffn.gate.bias" not in state  # hash layers have no selection bias
    assert "layers.3.attn.indexer.wq_b.weight" not in state  # HCA has no indexer


def test_official_state_dict_round_trips_exactly(tiny: DeepSeekV4Config) -> None:
    model = _trained_like(tiny)
    official = to_official(model.state_dict())
    back = from_official(official, tiny)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    again = to_official(back)
    assert again.keys() == official.keys()
    assert all(torch.equal(again[k], v) and again[k].dtype == v.dtype for k, v in official.items())


def test_bad_checkpoint_lists_every_problem_and_changes_nothing(tiny: DeepSeekV4Config) -> None:
    model = _trained_like(tiny)
    official = to_official(DeepSeekV4(tiny).state_dict())
    del official["layers.1.attn.wkv.weight"]
    del official["layers.3.ffn.experts.5.w2.weight"]
    official["layers.0.attn.bogus"] = torch.zeros(1)
    official["layers.2.ffn.experts.8.w1.weight"] = torch.zeros(32, 64)
    official["head.weight"] = torch.zeros(3, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_official_state_dict(model, official, source="bad.safetensors")
    message = str(err.value)
    for part in (
        "bad.safetensors",
        "missing (2): layers.1.attn.wkv.weight, layers.3.ffn.experts.5.w2.weight",
        "unexpected (2): layers.0.attn.bogus, layers.2.ffn.experts.8.w1.weight",
        "wrong shape (1): head.weight [3, 3] != [97, 64]",
    ):
        assert part in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_safetensors_directory_round_trip(tiny: DeepSeekV4Config, tmp_path: Path) -> None:
    model = _trained_like(tiny)
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 64
    loaded = load_pretrained(tmp_path)
    assert loaded.config == tiny
    tokens = torch.randint(0, tiny.vocab_size, (1, 12))
    assert torch.equal(loaded(tokens), model(tokens))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_pretrained(tmp_path / "nowhere")


_KILLED_MID_SAVE = """
import os, pathlib, signal, sys
from ttnpu.dsv4 import load_pretrained, save_pretrained
model = load_pretrained(sys.argv[1])
pathlib.Path.write_text = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # at config.json
save_pretrained(model, sys.argv[2])
"""


def test_a_save_killed_between_its_two_files_leaves_the_old_pair(
    tiny: DeepSeekV4Config, tmp_path: Path
) -> None:
    old, new = _trained_like(tiny), _trained_like(tiny.replace(vocab_size=101))
    save_pretrained(old, tmp_path / "model")
    save_pretrained(new, tmp_path / "new")
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path / "new"), str(tmp_path / "model")],
        check=False,
    )
    assert killed.returncode == -9
    loaded = load_pretrained(tmp_path / "model")  # not new weights beside the old config
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_save_replaces_a_pair_and_refuses_a_directory_with_other_files(
    tiny: DeepSeekV4Config, tmp_path: Path
) -> None:
    target = tmp_path / "model"
    save_pretrained(_trained_like(tiny), target)
    (target / "model-00002-of-00002.safetensors").write_bytes(b"")  # a stale shard
    new = _trained_like(tiny.replace(vocab_size=101))
    save_pretrained(new, target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # nothing left beside it
    assert load_pretrained(target).config == new.config
    (target / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        save_pretrained(_trained_like(tiny), target)
    assert load_pretrained(target).config == new.config
