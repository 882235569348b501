"""ttnpu-train and torchtitan's activation-checkpointing and compile sections: the recipes' choices,
the AC choice (a tyro subcommand) given anywhere on the command line or added to on a resume, and
an option the model cannot honour ending the command with status 2 and one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from ttnpu.trainer.cli import _ac_choice_last, main
from ttnpu.trainer.config_registry import CONFIGS


def test_the_small_recipes_do_not_checkpoint_and_compile_only_the_model() -> None:
    for name in ("dsv4_debug", "dsv4_small"):
        config = CONFIGS[name]()
        assert config.activation_checkpoint is None, name
        assert config.compile.components == ["model"] and not config.compile.enable, name
    flash = CONFIGS["dsv4_flash"]()
    assert isinstance(flash.activation_checkpoint, SelectiveAC.Config)  # torchtitan's default
    assert flash.compile.components == ["model"]


def test_the_ac_choice_goes_last_with_its_options() -> None:
    assert _ac_choice_last(["activation_checkpoint:full", "--training.steps", "3"]) == [
        "--training.steps", "3", "activation_checkpoint:full",
    ]  # fmt: skip
    given = [
        "activation-checkpoint:selective",
        "--activation_checkpoint.force_recompute_mm_shapes_by_fqns", "attn.wq_a", "attn.wkv",
        "--training.steps", "3",
        "--activation_checkpoint.debug",
    ]  # fmt: skip
    assert _ac_choice_last(given) == [
        "--training.steps", "3",
        "activation-checkpoint:selective",
        "--activation_checkpoint.force_recompute_mm_shapes_by_fqns", "attn.wq_a", "attn.wkv",
        "--activation_checkpoint.debug",
    ]  # fmt: skip
    # a resume adding a new choice: the saved one goes, with the options given for it
    resumed = [*given, "--training.steps", "5", "activation_checkpoint:full"]
    assert _ac_choice_last(resumed) == [
        "--training.steps", "3", "--training.steps", "5", "activation_checkpoint:full",
    ]  # fmt: skip
    assert _ac_choice_last(["--training.steps", "3"]) == ["--training.steps", "3"]


def test_the_reordered_command_line_parses_with_torchtitan() -> None:
    args = _ac_choice_last(["activation_checkpoint:full", "--training.steps", "3"])
    config = ConfigManager().parse_args(
        ["--module", "ttnpu.trainer", "--config", "dsv4_debug", *args]
    )
    assert isinstance(config.activation_checkpoint, FullAC.Config)
    assert config.training.steps == 3


def test_an_option_the_model_cannot_honour_exits_2_with_one_line(tmp_path: Path) -> None:
    executable = Path(sys.executable).parent / "ttnpu-train"
    done = subprocess.run(
        [str(executable), "--device", "cpu", "--compile.enable", "--compile.components",
         "model,loss"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "ttnpu-train: error: invalid config dsv4_debug: compile.components 'loss' is not "
        "supported by DSV4Trainer: it trains on the model's own loss (DeepSeekV4.loss: CE + MTP, "
        "balance and indexer terms), not on torchtitan's loss function; use "
        "--compile.components model"
    ]
    assert not any((tmp_path / "runs").iterdir())  # the run that never started left nothing


def test_memory_budget_ac_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--dump_folder",
        str(tmp_path),
        "--compile.enable",
        "activation_checkpoint:memory-budget",
    ]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "ttnpu-train: error: invalid config dsv4_debug: activation_checkpoint:memory-budget is "
        "not supported by the DeepSeek-V4 model"
    )
    assert not any(tmp_path.iterdir())
