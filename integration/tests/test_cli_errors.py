"""Every bad input to ``ttnpu-train`` exits 2 with one line on stderr naming the option and what
it expected, before anything is built, and leaves no run folder; ``--help`` answers without
importing torch. In-process (nothing here trains) but for the one ``--help`` subprocess."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ttnpu.trainer import bench
from ttnpu.trainer.cli import _init_logging, main
from ttnpu.trainer.config_registry import dsv4_debug

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HINT = " (every option: ttnpu-train --help-config)"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--training.steps", "-1"], "--training.steps -1: expected an integer >= 1"),
        (["--training.steps", "0"], "--training.steps 0: expected an integer >= 1"),
        (["--training.local_batch_size", "0"], "--training.local_batch_size 0: expected an"),
        (["--training.seq_len=-8"], "--training.seq_len -8: expected an integer >= 1"),
        (["--parallelism.expert_parallel_degree", "0"], "--parallelism.expert_parallel_degree 0"),
        (["--checkpoint.interval", "0"], "Checkpoint interval needs to be at least 1 step." + HINT),
        (
            ["--hf_assets_path", "{tmp}/no-tokenizer"],
            "--hf_assets_path {tmp}/no-tokenizer: expected an existing folder holding the "
            "tokenizer",
        ),
        (
            ["--dataloader.dataset_path", "{tmp}/no-corpus.jsonl.gz"],
            "--dataloader.dataset_path {tmp}/no-corpus.jsonl.gz: expected an existing file or "
            "folder",
        ),
        (["--dataloader.dataset", "c5"], "--dataloader.dataset c5: expected one of c4, c4_test"),
        (
            ["--module", "nope.mod"],
            "--module nope.mod: ttnpu-train trains the recipes of ttnpu.trainer (its --module is "
            "fixed); choose one with --config (see --list-configs)",
        ),
        (["--config", "dsv5"], "unknown --config 'dsv5'; expected one of ['dsv4_debug', "),
        (
            ["--config", "dsv4_flash"],  # no tokenizer at torchtitan's default path
            "--hf_assets_path ./tests/assets/tokenizer: expected an existing folder holding the "
            "tokenizer",
        ),
        (["--replicas", "x"], "argument --replicas: invalid int value: 'x'"),
        (
            ["--dump_folder", "{tmp}/a-file/runs"],
            "--dump_folder {tmp}/a-file/runs: expected a folder this user can create and write",
        ),
        (
            ["--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2"],
            "fault_tolerance.replica_id 2 must be in [0, group_size = 2)",
        ),
        (
            ["--training.stpes", "3"],
            "unrecognized option --training.stpes; did you mean --training.steps?" + HINT,
        ),
        (
            ["--training.steps", "ten"],
            "--training.steps: invalid literal for int() with base 10: 'ten'" + HINT,
        ),
        (["--device", "tpu"], "--device tpu: expected one of auto, cpu, cuda, npu" + HINT),
    ],
)
def test_a_bad_input_exits_2_with_one_line_and_no_run_folder(
    args: list[str],
    line: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    runs = tmp_path / "runs"
    argv = [a.format(tmp=tmp_path) for a in args]
    assert main(["--dump_folder", str(runs), *argv]) == 2
    (printed,) = capsys.readouterr().err.splitlines()
    assert printed.startswith("ttnpu-train: error: " + line.format(tmp=tmp_path))
    assert not runs.exists()


def test_shared_checkpoints_without_fault_tolerance_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked where the trainer starts (the launcher of ``--replicas N`` adds the enable to its
    groups' command lines, so the config it parses has none): one line, exit 2, no run left."""
    runs = tmp_path / "runs"
    args = ["--dump_folder", str(runs), "--fault_tolerance.checkpoint_folder", "../checkpoint"]
    assert main(args) == 2
    (printed,) = capsys.readouterr().err.splitlines()
    assert printed == (
        "ttnpu-train: error: invalid config dsv4_debug: fault_tolerance.checkpoint_folder needs "
        "fault_tolerance.enable (it is where replica groups share their checkpoints)"
    )
    assert not any(runs.iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path.chmod(0o555)
    try:
        assert main(["--dump_folder", str(tmp_path / "runs")]) == 2
    finally:
        tmp_path.chmod(0o755)
    (printed,) = capsys.readouterr().err.splitlines()
    assert printed.endswith("expected a folder this user can create and write")
    assert list(tmp_path.iterdir()) == []


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from ttnpu.trainer.cli import main as train\n"
        "from ttnpu.trainer.drill.cli import main as drill\n"
        "for main in (train, drill):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, exit.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchtitan', "
        "'matplotlib'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "usage: ttnpu-train" in done.stdout and "usage: ttnpu-drill" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_bench_parses_its_arguments_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        bench.main(["--help"])
    assert help_exit.value.code == 0
    assert "--rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad_exit:
        bench.main(["--rounds", "0"])
    assert bad_exit.value.code == 2
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err


def test_replica_log_lines_carry_the_id_and_torchft_logs_stay_at_warning() -> None:
    config = dsv4_debug()
    config.fault_tolerance.enable, config.fault_tolerance.replica_id = True, 1
    _init_logging(config, torchft_logs=False)
    record = logging.LogRecord("root", logging.INFO, __file__, 1, "step:  2", None, None)
    (handler,) = logging.getLogger().handlers
    assert " - replica 1 - root - INFO - step:  2" in handler.format(record)
    assert not logging.getLogger("torchft.manager").isEnabledFor(logging.INFO)
    assert not logging.getLogger("torchft_quorums").isEnabledFor(logging.INFO)
    _init_logging(config, torchft_logs=True)
    assert logging.getLogger("torchft.manager").isEnabledFor(logging.INFO)
