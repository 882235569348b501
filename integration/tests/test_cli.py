"""ttnpu-train's command line: recipe choice, run folders, and the errors it reports before
anything is built (these run in-process: nothing here starts training)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ttnpu.trainer import write_checksums
from ttnpu.trainer.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _run_folder(tmp_path: Path, *, steps: tuple[int, ...] = (2,)) -> Path:
    run = tmp_path / "runs" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "command.json").write_text(json.dumps({"config": "dsv4_debug", "overrides": []}))
    for step in steps:
        dcp.save({"w": torch.ones(100)}, checkpoint_id=str(run / "checkpoint" / f"step-{step}"))
    return run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_list_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-configs"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["dsv4_debug", "dsv4_small", "dsv4_flash", "dsv4_flash_ft"]


def test_unknown_config_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "dsv5"]) == 2
    assert "unknown --config 'dsv5'; expected one of" in capsys.readouterr().err


def test_resume_of_a_folder_that_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--resume", str(tmp_path)]) == 2
    assert "not a run folder (no command.json)" in capsys.readouterr().err


def test_resume_with_a_different_recipe_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path)
    assert main(["--resume", str(run), "--config", "dsv4_small"]) == 2
    assert "the run used --config dsv4_debug, not dsv4_small" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path, steps=())
    assert main(["--resume", str(run)]) == 2
    assert "no checkpoint folder" in capsys.readouterr().err


def test_resume_from_a_corrupt_checkpoint_names_the_file_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path, steps=(2, 4))
    data = next((run / "checkpoint" / "step-4").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    before = _snapshot(tmp_path)
    assert main(["--resume", str(run)]) == 2
    assert f"{data.name} is truncated" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


def test_resume_from_a_named_step_checks_that_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path, steps=(2,))
    assert main(["--resume", str(run), "--checkpoint.load_step", "3"]) == 2
    assert "step-3: incomplete" in capsys.readouterr().err


def test_corrupt_command_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path)
    (run / "command.json").write_text("{not json")
    assert main(["--resume", str(run)]) == 2
    assert "command.json is corrupt" in capsys.readouterr().err


def test_a_run_name_that_already_holds_a_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path)
    argv = ["--dump_folder", str(run.parent), "--run-name", run.name]
    assert main(argv) == 2
    assert f"already holds a run; use --resume {run}" in capsys.readouterr().err


def test_ranks_of_a_torchrun_job_must_share_a_run_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--dump_folder", str(tmp_path)]) == 2
    assert "pass --run-name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_resume_from_a_bit_flipped_checkpoint_names_the_file_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_folder(tmp_path, steps=(2,))
    step = run / "checkpoint" / "step-2"
    write_checksums(step)
    data = next(step.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-20] ^= 0x01
    data.write_bytes(bytes(raw))
    before = _snapshot(tmp_path)
    assert main(["--resume", str(run)]) == 2
    assert f"{data.name} does not match its SHA-256 (corrupt)" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0"], "--replicas 0 must be >= 1"),
        (["--replicas", "2", "--min-replicas", "3"], "--min-replicas 3 in [1, replicas]"),
    ],
)
def test_a_bad_replica_layout_is_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--max-restarts", "2"], ["--replicas", "2", "--max-restarts", "-1"]]
)
def test_max_restarts_without_replicas_or_below_zero_is_refused(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert f"--max-restarts {args[-1]}: needs --replicas >= 2" in capsys.readouterr().err


def test_a_replica_restarted_by_torchelastic_rejoins_its_run_folder(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same command after a restart is no "run already exists" error: it continues there
    (a first start with that command is refused, as above)."""
    from ttnpu.trainer.cli import _restarted_run

    run = _run_folder(tmp_path)
    assert _restarted_run(run.parent, run.name) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert _restarted_run(run.parent, run.name) == run
    assert f"restarted by torchelastic (restart 2); rejoining in {run}" in capfd.readouterr().err
    assert _restarted_run(run.parent, "died-before-its-start") is None


def test_a_replica_that_left_the_job_is_not_restarted_into_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its torchelastic restart exits 0 at once (which ends the agent) and changes nothing."""
    from ttnpu.trainer.launcher import left_status, record_left

    run = _run_folder(tmp_path)
    assert left_status(run) is None
    record_left(run, 3)
    before = _snapshot(run)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(["--dump_folder", str(run.parent), "--run-name", run.name]) == 0
    assert "this replica left the job (status 3)" in capfd.readouterr().err
    assert _snapshot(run) == before and left_status(run) == 3


def test_a_lighthouse_address_needs_replicas_and_must_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--lighthouse", "http://127.0.0.1:1"]) == 2
    assert "--lighthouse http://127.0.0.1:1: needs --replicas >= 2" in capsys.readouterr().err
    args = ["--replicas", "2", "--lighthouse", "http://127.0.0.1:1", "--dump_folder", str(tmp_path)]
    assert main(args) == 2
    assert "--lighthouse: cannot reach the Lighthouse at http://127.0.0.1:1" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []  # refused before the run folder is made


def test_a_lighthouse_that_cannot_start_ends_the_launch_in_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ttnpu.ft.lighthouse

    def missing() -> str:
        raise ttnpu.ft.lighthouse.LighthouseStartError("torchft_lighthouse not found")

    monkeypatch.setattr(ttnpu.ft.lighthouse, "_lighthouse_program", missing)
    assert main(["--replicas", "2", "--dump_folder", str(tmp_path)]) == 1
    assert "ttnpu-train: error: torchft_lighthouse not found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_supervisor_restarts_a_dead_lighthouse_up_to_max_restarts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ttnpu.ft import LighthouseProcess, check_lighthouse
    from ttnpu.trainer.launcher import _Supervisor

    def kill(lighthouse: LighthouseProcess) -> None:
        os.kill(lighthouse.pid or 0, signal.SIGKILL)
        while lighthouse.poll() is None:
            time.sleep(0.02)

    with LighthouseProcess() as lighthouse:
        supervisor = _Supervisor([], [], lighthouse, max_restarts=1)
        try:
            first = lighthouse.pid
            kill(lighthouse)
            supervisor._watch()
            assert lighthouse.pid != first and check_lighthouse(lighthouse.address)
            assert "the Lighthouse died (status -9); restarted at" in capsys.readouterr().out
            kill(lighthouse)
            supervisor._watch()
            supervisor._watch()  # reported once
            assert lighthouse.poll() == -9
            out = capsys.readouterr().out
            assert out.count("after 1 restart(s); not restarted") == 1
        finally:
            supervisor.close()


def test_a_supervisor_that_exited_is_gone_even_before_it_is_reaped() -> None:
    from ttnpu.trainer.cli import supervisor_gone

    assert not supervisor_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not supervisor_gone(child.pid):  # exited, but a zombie until reaped below
        assert time.monotonic() < deadline, "an exited, unreaped process counts as running"
        time.sleep(0.05)
    assert child.poll() == 0 and supervisor_gone(child.pid)


def test_replicas_under_torchrun_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--replicas", "2", "--dump_folder", str(tmp_path)]) == 2
    assert "under torchrun use --fault_tolerance.enable" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("error", "status"),
    [("persistent", 3), ("split brain", 4), ("no Lighthouse", 5)],
)
def test_a_replica_taken_out_exits_with_its_status_and_one_line(
    error: str, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from ttnpu.ft import LighthouseUnreachable, SplitBrainError
    from ttnpu.trainer import PersistentSDCError
    from ttnpu.trainer.cli import _train

    kinds = {"persistent": PersistentSDCError, "split brain": SplitBrainError}

    class Trainer:
        closed = False
        stopped = None

        def train(self) -> None:
            raise kinds.get(error, LighthouseUnreachable)(error)

        def close(self) -> None:
            self.closed = True

    trainer = Trainer()
    assert _train(trainer) == status and trainer.closed
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ttnpu-train: {error}")


def test_sigterm_asks_the_trainer_to_stop_and_the_stop_ends_in_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A SIGTERM before the trainer exists is handed to it; a second one changes nothing; the
    handlers from before are back afterwards."""
    from ttnpu.trainer.cli import StopSignals, _train

    class Trainer:
        def __init__(self) -> None:
            self.stopped: str | None = None
            self.asked: list[str] = []

        def request_stop(self, why: str) -> None:
            self.asked.append(why)

        def train(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            self.stopped = "stopped by SIGTERM at step 3; checkpoint /run/checkpoint/step-3"

        def close(self) -> None:
            pass

    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        trainer = Trainer()
        signals.attach(trainer)
        assert _train(trainer) == 0
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert trainer.asked == ["SIGTERM"]
    assert capfd.readouterr().err.splitlines() == [
        "ttnpu-train: SIGTERM: stopping after the current step, with a checkpoint (SIGINT again: "
        "exit at once)",
        "ttnpu-train: stopped by SIGTERM at step 3; checkpoint /run/checkpoint/step-3",
    ]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process table")
def test_the_supervisor_counts_only_the_agents_trainer_children_as_its_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A helper the agent runs beside its replica (here a ``sleep``) is no replica: the
    supervisor neither lists it nor reports the replica appearing after it as a restart."""
    from ttnpu.trainer.launcher import _Supervisor, _workers

    script = (
        "import subprocess, sys, time\n"
        "helper = subprocess.Popen(['sleep', '60'])\n"
        "time.sleep(0.5)\n"
        "replica = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)',\n"
        "                            '--supervisor-pid', '1'])\n"
        "print(helper.pid, replica.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        supervisor = _Supervisor([agent], [tmp_path])
        deadline = time.monotonic() + 30
        while not _workers(agent.pid):  # the helper runs alone for half a second first
            supervisor._watch()
            assert time.monotonic() < deadline, "the replica child never showed"
            time.sleep(0.05)
        assert agent.stdout is not None
        helper, replica = map(int, agent.stdout.readline().split())
        assert _workers(agent.pid) == [replica]
        supervisor._watch()
        assert supervisor.restarts == [0]
        assert "torchelastic restarted it" not in capsys.readouterr().out
        assert helper not in _workers(agent.pid)
    finally:
        for child in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        agent.kill()
        agent.wait()
