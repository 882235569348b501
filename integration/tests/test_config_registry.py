"""The recipes, parsed the way ttnpu-train parses them: torchtitan's ConfigManager and tyro."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from ttnpu.trainer import CONFIGS, DATASET_NAME, DeepSeekV4LM, DSV4Trainer, tokenizer_path


def _parse(*args: str) -> DSV4Trainer.Config:
    config = ConfigManager().parse_args(["--module", "ttnpu.trainer", *args])
    assert isinstance(config, DSV4Trainer.Config)
    return config


def test_the_registry_has_the_four_recipes_and_each_parses() -> None:
    assert list(CONFIGS) == ["dsv4_debug", "dsv4_small", "dsv4_flash", "dsv4_flash_ft"]
    flavors = {}
    for name in CONFIGS:
        config = _parse("--config", name)
        assert config.model_spec is not None
        assert isinstance(config.model_spec.model, DeepSeekV4LM.Config)
        flavors[name] = config.model_spec.model.flavor
        assert config.checkpoint.enable and not config.checkpoint.last_save_model_only
    assert flavors == {
        "dsv4_debug": "debug",
        "dsv4_small": "small",
        "dsv4_flash": "flash",
        "dsv4_flash_ft": "flash",
    }


def test_dsv4_debug_trains_on_the_bundled_corpus_with_tensorboard_and_checkpoints() -> None:
    config = _parse("--config", "dsv4_debug")
    assert config.hf_assets_path == tokenizer_path()
    assert isinstance(config.dataloader, HuggingFaceTextDataLoader.Config)
    assert config.dataloader.dataset == DATASET_NAME
    assert config.metrics.enable_tensorboard and config.metrics.log_freq == 1
    assert config.device == "auto"
    model = config.model_spec.model if config.model_spec else None
    assert isinstance(model, DeepSeekV4LM.Config) and model.dsv4().vocab_size == 2048


def test_dsv4_flash_ft_is_one_replica_group_of_64_dies_fsdp_64_by_ep_64() -> None:
    config = _parse("--config", "dsv4_flash_ft", "--fault_tolerance.replica_id", "1")
    assert config.parallelism.data_parallel_shard_degree == 64
    assert config.parallelism.expert_parallel_degree == 64
    ft = config.fault_tolerance
    assert (ft.enable, ft.group_size, ft.replica_id, ft.min_replica_size) == (True, 2, 1, 1)
    assert ft.shared_checkpoints(Path("/run/replica_1")) == Path("/run/checkpoint")  # one copy
    assert config.spike.enable and config.sdc.enable
    model = config.model_spec.model if config.model_spec else None
    assert isinstance(model, DeepSeekV4LM.Config) and model.dsv4().n_layers == 43


@pytest.mark.parametrize(
    "names",
    [
        ("--fault_tolerance.group_size", "--fault_tolerance.min_replica_size"),  # torchtitan's
        ("--fault_tolerance.replicas", "--fault_tolerance.min_replicas"),  # the earlier aliases
    ],
)
def test_fault_tolerance_takes_torchtitans_field_names_and_the_earlier_ones(
    names: tuple[str, str],
) -> None:
    config = _parse("--config", "dsv4_debug", names[0], "3", names[1], "2")
    ft = config.fault_tolerance
    assert (ft.group_size, ft.min_replica_size) == (3, 2)
    assert (ft.replicas, ft.min_replicas) == (3, 2)  # the earlier names read the same fields


def test_dotted_overrides_apply_on_top_of_the_recipe() -> None:
    config = _parse(
        "--config", "dsv4_debug", "--training.steps", "7", "--device", "cpu",
        "--checkpoint.interval", "3",
    )  # fmt: skip
    assert (config.training.steps, config.device, config.checkpoint.interval) == (7, "cpu", 3)
    assert config.training.seq_len == CONFIGS["dsv4_debug"]().training.seq_len


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (("--fault_tolerance.replica_id", "2"), "replica_id 2 must be in"),
        (("--fault_tolerance.min_replica_size", "2"), "min_replica_size 2 must be in"),
        (("--fault_tolerance.max_attempts", "1"), "max_attempts must be >= 2"),
        (("--fault_tolerance.collective_timeout_steps", "2"), r"steps must be 0 \(fixed\) or >= 3"),
        (("--sdc.inject_step", "3", "--sdc.no-enable"), "needs sdc.enable"),
        (("--spike.warmup_steps", "1"), "warmup_steps must be >= 2"),
        (("--spike.inject_scale", "0"), "inject_scale > 0"),
    ],
)
def test_feature_switches_are_validated_by_name(override: tuple[str, ...], message: str) -> None:
    config = _parse("--config", "dsv4_debug", *override)
    sections = (config.fault_tolerance, config.sdc, config.spike)
    with pytest.raises(ValueError, match=message):
        for section in sections:
            section.validate()


def test_a_bad_override_is_rejected_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse("--config", "dsv4_debug", "--training.stepz", "7")
    assert exit_info.value.code == 2
    assert "--training.stepz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--config", "dsv4_debug", "--device", "tpu")
