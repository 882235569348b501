import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config


def _count(config: DeepSeekV4Config) -> tuple[int, int]:
    with torch.device("meta"):
        model = DeepSeekV4(config)
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return total, mtp


def test_flash_counts_284b_parameters_without_mtp() -> None:
    total, mtp = _count(DeepSeekV4Config.from_flavor("flash"))
    assert mtp > 0
    assert abs((total - mtp) / 284.3e9 - 1) < 0.002


def test_flash_layer_schedule_matches_the_official_config() -> None:
    c = DeepSeekV4Config.from_flavor("flash")
    assert c.compress_ratios[:3] == (0, 0, 4) and c.compress_ratios[-1] == 4
    assert sum(r == 4 for r in c.compress_ratios) == 21
    assert sum(r == 128 for r in c.compress_ratios) == 20


@pytest.mark.parametrize("name", ["micro", "debug", "small", "flash", "pro"])
def test_hf_config_round_trip(name: str) -> None:
    config = DeepSeekV4Config.from_flavor(name)
    assert DeepSeekV4Config.from_hf_config(config.to_hf_config()) == config


def test_reads_the_official_flash_config_fields() -> None:
    official = DeepSeekV4Config.from_flavor("flash").to_hf_config()
    del official["layer_types"], official["compress_rates"]  # the official file has neither
    assert len(official["compress_ratios"]) == 44
    assert DeepSeekV4Config.from_hf_config(official) == DeepSeekV4Config.from_flavor("flash")


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 flavor 'huge'"):
        DeepSeekV4Config.from_flavor("huge")
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepSeekV4Config(n_layers=3)
    hf = DeepSeekV4Config.from_flavor("debug").to_hf_config()
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        DeepSeekV4Config.from_hf_config(hf)


def test_bad_indexer_settings_are_named() -> None:
    with pytest.raises(ValueError, match="indexer_stage must be 'dense' or 'sparse', got 'warm'"):
        DeepSeekV4Config(indexer_stage="warm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="indexer_loss_weight"):
        DeepSeekV4Config(indexer_loss_weight=-1.0)
