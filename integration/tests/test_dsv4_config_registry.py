"""``--module ttnpu.dsv4 --config <name>`` resolves through torchtitan's own ConfigManager."""

from __future__ import annotations

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.trainer import Trainer

from ttnpu.dsv4 import DeepSeekV4Config
from ttnpu.dsv4.titan import DeepSeekV4LM


@pytest.mark.parametrize("name", ["debug", "small", "flash", "pro"])
def test_each_flavor_resolves_to_a_trainer_config_on_its_model_spec(name: str) -> None:
    config = ConfigManager().parse_args(["--module", "ttnpu.dsv4", "--config", name])
    assert isinstance(config, Trainer.Config)
    assert config.model_spec is not None
    model = config.model_spec.model
    assert isinstance(model, DeepSeekV4LM.Config) and model.flavor == name
    assert model.dsv4() == DeepSeekV4Config.from_flavor(name)
    assert config.training.seq_len <= model.dsv4().max_seq_len


def test_cli_overrides_apply_on_top_of_the_recipe() -> None:
    config = ConfigManager().parse_args(
        ["--module", "ttnpu.dsv4", "--config", "debug", "--training.steps", "3"]
    )
    assert isinstance(config, Trainer.Config)
    assert config.training.steps == 3
    assert config.training.seq_len == 256


def test_an_unknown_recipe_lists_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"'huge' not found.*'debug'.*'flash'.*'pro'.*'small'"):
        ConfigManager().parse_args(["--module", "ttnpu.dsv4", "--config", "huge"])


def test_the_debug_recipe_builds_a_model_that_gives_logits() -> None:
    """What the stock torchtitan Trainer does with the recipe: build on meta, materialise, init,
    and call the model on tokens to get logits for its cross-entropy."""
    config = ConfigManager().parse_args(["--module", "ttnpu.dsv4", "--config", "debug"])
    assert config.model_spec is not None
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (1, 16, 2048) and torch.isfinite(logits).all()
