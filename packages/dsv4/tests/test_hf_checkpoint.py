"""transformers' DeepseekV4 checkpoints in and out: folders written by transformers load with one
call and give its logits, ours load in transformers, and bad folders are refused in one line
before anything changes."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, load_pretrained, load_weights, save_pretrained
from ttnpu.dsv4.hf_checkpoint import CheckpointError, from_hf, to_hf

transformers = pytest.importorskip("transformers")


def _transformers_model(config: DeepSeekV4Config) -> "transformers.PreTrainedModel":
    """transformers' DeepseekV4 with random weights, every tensor off its trivial init."""
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf_config()))
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, config.n_routed_experts, tensor.shape))
            else:
                tensor.add_(torch.randn_like(tensor) * 0.05)
    return hf.eval()


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("original_format", [True, False], ids=["official-names", "hf-names"])
def test_a_folder_saved_by_transformers_loads_with_its_logits(
    tiny: DeepSeekV4Config,
    tmp_path: Path,
    original_format: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hf = _transformers_model(tiny)
    hf.save_pretrained(tmp_path, max_shard_size="40KB", save_original_format=original_format)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2  # sharded, with an index
    (tmp_path / "unrelated.safetensors").write_bytes(b"not read: the index does not name it")
    with caplog.at_level(logging.WARNING):
        model = load_pretrained(tmp_path)
    assert model.config.n_mtp_layers == 0 and "no MTP weights" in caplog.text
    assert model.config == tiny.replace(
        n_mtp_layers=0, extra_hf_fields=model.config.extra_hf_fields
    )
    tokens = torch.randint(0, tiny.vocab_size, (2, 37))
    theirs = _logits(hf, tokens)
    assert theirs.abs().max() > 0.5
    torch.testing.assert_close(_logits(model, tokens), theirs, atol=2e-5, rtol=1e-4)


def test_our_hf_layout_loads_in_transformers_and_round_trips(
    tiny: DeepSeekV4Config, tmp_path: Path
) -> None:
    model = DeepSeekV4(tiny)
    with torch.no_grad():
        for moe in (m for m in model.modules() if hasattr(m, "expert_bias")):
            if not moe.hash_routed:
                moe.expert_bias.normal_(0, 0.1)
    save_pretrained(model, tmp_path, layout="hf", shard_bytes=64_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    tokens = torch.randint(0, tiny.vocab_size, (2, 37))
    torch.testing.assert_close(
        _logits(model, tokens), _logits(hf.eval(), tokens), atol=2e-5, rtol=1e-4
    )
    loaded = load_pretrained(tmp_path, source="hf")  # MTP included: it is in our folder
    assert loaded.config == tiny
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_the_name_table_is_transformers_own_and_inverts(tiny: DeepSeekV4Config) -> None:
    ours = DeepSeekV4(tiny.replace(n_mtp_layers=0)).state_dict()
    theirs = transformers.DeepseekV4ForCausalLM(
        transformers.DeepseekV4Config(**tiny.to_hf_config())
    ).state_dict()
    hf = to_hf(ours)
    assert {k: v.shape for k, v in hf.items()} == {k: v.shape for k, v in theirs.items()}
    back = from_hf(hf)
    hash_bias = {k for k in ours if k.endswith("expert_bias") and k not in back}
    assert hash_bias == {"layers.0.ffn.expert_bias", "layers.1.ffn.expert_bias"}  # hash layers
    assert all(torch.equal(back[k], ours[k]) for k in ours.keys() - hash_bias)


def _hf_folder(config: DeepSeekV4Config, path: Path) -> dict[str, torch.Tensor]:
    weights = {k: v.contiguous() for k, v in to_hf(DeepSeekV4(config).state_dict()).items()}
    (path / "config.json").write_text(json.dumps(config.to_hf_config()))
    return weights


def test_a_bad_folder_is_refused_in_one_line_and_changes_nothing(
    tiny: DeepSeekV4Config, tmp_path: Path
) -> None:
    weights = _hf_folder(tiny, tmp_path)
    del weights["model.layers.1.self_attn.kv_proj.weight"]
    weights["model.layers.0.self_attn.bogus"] = torch.zeros(1)
    weights["lm_head.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "model.safetensors")
    model = DeepSeekV4(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_weights(model, tmp_path)
    message = str(err.value)
    assert "\n" not in message
    for part in (
        "missing (1): model.layers.1.self_attn.kv_proj.weight",
        "unexpected (1): model.layers.0.self_attn.bogus",
        "wrong shape (1): lm_head.weight [3, 3] != [97, 64]",
    ):
        assert part in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"does not hold official DeepSeek-V4 names"):
        load_pretrained(tmp_path, source="official")


def test_missing_experts_are_named_as_the_folder_spells_them(
    tiny: DeepSeekV4Config, tmp_path: Path
) -> None:
    from ttnpu.dsv4 import to_official

    official = to_official(DeepSeekV4(tiny).state_dict())
    del official["layers.3.ffn.experts.5.w3.weight"]
    save_file(official, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_hf_config()))
    with pytest.raises(CheckpointError, match=r"missing \(1\): layers\.3\.ffn\.experts\.5\.w3"):
        load_pretrained(tmp_path)


def test_a_folder_of_neither_layout_or_without_weights_is_named(tmp_path: Path) -> None:
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"is not a DeepSeek-V4 checkpoint: none of its 1 tensor"):
        load_weights(DeepSeekV4(DeepSeekV4Config.from_flavor("micro")), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors\.index\.json or model"):
        load_weights(DeepSeekV4(DeepSeekV4Config.from_flavor("micro")), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "gone.safetensors"}}'
    )
    with pytest.raises(FileNotFoundError, match=r"names files that are not there: gone"):
        load_weights(DeepSeekV4(DeepSeekV4Config.from_flavor("micro")), tmp_path)


def test_the_readme_checkpoint_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Checkpoints", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert f"prints `{printed}`" in section
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "dsv4-hf")
    assert hf.config.hidden_size == DeepSeekV4Config.from_flavor("micro").dim
