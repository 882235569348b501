"""Which checkpoint a resume or a rollback may load, against real torch.distributed.checkpoint
saves: the newest that verifies; every newer one is skipped with why."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ttnpu.routing import NoRollbackTargetError
from ttnpu.trainer import (
    CheckpointError,
    ChecksummedCheckpointManager,
    DeepSeekV4LM,
    SpikeRecovery,
    model_spec,
    newest_verified_checkpoint,
    verify_checkpoint,
    write_checksums,
)
from ttnpu.trainer.run_folder import CHECKSUMS, _local_reason
from ttnpu.trainer.spikes import SpikeGuard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(folder: Path, step: int, *, manifest: bool = True) -> Path:
    path = folder / f"step-{step}"
    state = {"w": torch.arange(1000, dtype=torch.float32) * step, "b": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    if manifest:
        write_checksums(path)
    return path


def _flip_a_bit(path: Path) -> Path:
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # same size: only the hash can tell
    data.write_bytes(bytes(raw))
    return data


def test_the_newest_verified_checkpoint_wins_and_newer_ones_are_named(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    verified = _save(tmp_path, 10)
    (tmp_path / "step-12").mkdir()  # a save killed before .metadata was written
    (tmp_path / "step-12" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "notes").mkdir()
    chosen = newest_verified_checkpoint(tmp_path)
    assert (chosen.path, chosen.step) == (verified, 10)
    [(skipped, why)] = chosen.skipped
    assert skipped == tmp_path / "step-12" and why.startswith("incomplete (no .metadata")


def test_a_flipped_bit_in_the_newest_falls_back_to_the_previous(tmp_path: Path) -> None:
    previous = _save(tmp_path, 4)
    data = _flip_a_bit(_save(tmp_path, 6))
    chosen = newest_verified_checkpoint(tmp_path)
    assert chosen.path == previous
    assert chosen.skipped == (
        (tmp_path / "step-6", f"file {data.name} does not match its SHA-256 (corrupt)"),
    )
    with pytest.raises(CheckpointError, match=rf"step-6: file {data.name} does not match"):
        verify_checkpoint(tmp_path / "step-6")


def test_a_checkpoint_without_a_manifest_is_unverified(tmp_path: Path) -> None:
    verified = _save(tmp_path, 4)
    unverified = _save(tmp_path, 6, manifest=False)
    _flip_a_bit(unverified)  # unseen without a manifest
    chosen = newest_verified_checkpoint(tmp_path)
    assert chosen.path == verified
    [(skipped, why)] = chosen.skipped
    assert skipped == unverified
    assert why == f"unverified (no {CHECKSUMS}; --checkpoint.allow_unverified accepts it)"
    allowed = newest_verified_checkpoint(tmp_path, allow_unverified=True)
    assert (allowed.path, allowed.skipped) == (unverified, ())  # structural checks only


def test_when_none_verifies_every_skipped_one_is_named(tmp_path: Path) -> None:
    truncated = next(_save(tmp_path, 2).glob("*.distcp"))
    truncated.write_bytes(truncated.read_bytes()[:100])
    _save(tmp_path, 4, manifest=False)
    with pytest.raises(CheckpointError) as err:
        newest_verified_checkpoint(tmp_path)
    assert str(err.value).startswith(
        f"no checkpoint in {tmp_path} verifies (step-4: unverified (no {CHECKSUMS}; "
        f"--checkpoint.allow_unverified accepts it); step-2: data file {truncated.name} is "
        "truncated (100 bytes, needs "
    )


def test_missing_files_garbage_and_empty_folders_are_clear_errors(tmp_path: Path) -> None:
    path = _save(tmp_path, 4)
    data = next(path.glob("*.distcp"))
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"file {data.name} is missing"):
        verify_checkpoint(path)
    (path / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"unreadable \.metadata"):
        verify_checkpoint(path, allow_unverified=True)
    (path / CHECKSUMS).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"unreadable {CHECKSUMS}"):
        verify_checkpoint(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"verifies \(there is none\)"):
        newest_verified_checkpoint(empty)
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        newest_verified_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(tmp_path / "absent")


def test_each_rank_hashes_only_its_share_and_the_shares_cover_every_file(tmp_path: Path) -> None:
    path = tmp_path / "step-2"
    dcp.save({"w": torch.ones(100)}, checkpoint_id=str(path), no_dist=True)
    (path / "config.json").write_text("{}")
    write_checksums(path)
    names = sorted(json.loads((path / CHECKSUMS).read_text()))
    assert names == [".metadata", "__0_0.distcp", "config.json"]
    data = _flip_a_bit(path)
    assert _local_reason(path, False, 0, 2) is None  # .metadata and config.json
    assert _local_reason(path, False, 1, 2) == (
        f"file {data.name} does not match its SHA-256 (corrupt)"
    )
    assert _local_reason(path, False, 2, 3) is None  # config.json only


class _Counter:
    """A Stateful part besides the model (optimizer, LR schedule, data position)."""

    def __init__(self) -> None:
        self.n = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n.copy_(state["n"])


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo world (torchtitan's asynchronous saves need a process group)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _manager(folder: Path, model: torch.nn.Module, **fields: Any) -> ChecksummedCheckpointManager:
    fields = {"keep_latest_k": 0, **fields}
    config = ChecksummedCheckpointManager.Config(
        enable=True, folder=str(folder), interval=1, initial_load_model_only=False, **fields
    )
    return ChecksummedCheckpointManager(
        config, dataloader=None, model_parts=[model], optimizers=_Counter(),  # type: ignore[arg-type]
        lr_schedulers=_Counter(), states={}, sd_adapter=None,  # type: ignore[arg-type]
    )  # fmt: skip


def _train_and_save(manager: ChecksummedCheckpointManager, model: torch.nn.Module, steps: int):
    weights = {}
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(step)
        weights[step] = model.weight.clone()
    return weights


def test_the_manager_loads_the_newest_verified_step_and_says_which_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, one_rank: None
) -> None:
    model = torch.nn.Linear(4, 4)
    manager = _manager(tmp_path, model)
    weights = _train_and_save(manager, model, 3)
    data = _flip_a_bit(tmp_path / "step-3")
    (tmp_path / "step-2" / CHECKSUMS).unlink()
    with caplog.at_level(logging.INFO):
        assert manager.load()
    assert torch.equal(model.weight, weights[1])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"checkpoint {tmp_path}/step-3 skipped: file {data.name} does not match its SHA-256 "
        "(corrupt)",
        f"checkpoint {tmp_path}/step-2 skipped: unverified (no {CHECKSUMS}; "
        "--checkpoint.allow_unverified accepts it)",
        f"resuming from step 1: {tmp_path}/step-1 verifies",
    ]
    with pytest.raises(CheckpointError, match="step-2: unverified"):
        manager.load(step=2)  # an explicit step is refused, not replaced
    assert torch.equal(model.weight, weights[1])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert _manager(tmp_path, model, allow_unverified=True).load()
    assert torch.equal(model.weight, weights[2])
    assert (
        f"resuming from step 2: {tmp_path}/step-2 is unverified (no {CHECKSUMS}), allowed by "
        "--checkpoint.allow_unverified"
    ) in [r.getMessage() for r in caplog.records]
    (tmp_path / "step-1" / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(step-3: .*step-1"):
        manager.load()  # nothing changed
    assert torch.equal(model.weight, weights[2])
    manager.close()


def test_an_asynchronous_save_is_sealed_once_it_is_known_finished(
    tmp_path: Path, one_rank: None
) -> None:
    model = torch.nn.Linear(4, 4)
    manager = _manager(tmp_path, model, async_mode="async")
    assert manager.save(1)
    assert not (tmp_path / "step-1" / CHECKSUMS).exists()  # in flight: not known finished
    assert manager.save(2)  # waits for step 1 first
    verify_checkpoint(tmp_path / "step-1")
    assert not (tmp_path / "step-2" / CHECKSUMS).exists()
    manager.close()  # torchtitan's close does not wait; this one seals the last save
    verify_checkpoint(tmp_path / "step-2")


def test_the_rollback_target_is_the_newest_verified_checkpoint_before_the_onset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    parts = {"model.w": torch.ones(2), "optimizer.s": torch.ones(2), "lr_scheduler.e": 1,
             "dataloader.d": torch.ones(1), "train_state.step": 1}  # fmt: skip
    for step in (2, 4, 5, 8):
        dcp.save(parts, checkpoint_id=str(tmp_path / f"step-{step}"), no_dist=True)
        if step != 5:
            write_checksums(tmp_path / f"step-{step}")
    data = _flip_a_bit(tmp_path / "step-4")
    guard = SpikeGuard(SpikeRecovery(), DeepSeekV4LM(model_spec("debug").model), print, 1)
    with caplog.at_level(logging.WARNING):
        plan = guard.plan(tmp_path, onset=7)
    assert plan.target.step == 2
    skipped = [(info.step, why) for info, why in plan.skipped]
    assert skipped == [
        (8, "step 8 is not before the onset 7"),
        (5, f"unverified (no {CHECKSUMS}; --checkpoint.allow_unverified accepts it)"),
        (4, f"file {data.name} does not match its SHA-256 (corrupt)"),
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"rollback: checkpoint {tmp_path}/step-{step} skipped: {why}" for step, why in skipped
    ]
    assert guard.plan(tmp_path, onset=7, allow_unverified=True).target.step == 5
    (tmp_path / "step-2" / CHECKSUMS).unlink()
    with pytest.raises(NoRollbackTargetError, match=r"not verified: step 5 .*; step 4 .*; step 2"):
        guard.plan(tmp_path, onset=7)
    # the checkpoints at or after the onset go; the unverified ones before it stay
    assert SpikeGuard.discard_from(tmp_path, plan.onset) == [tmp_path / "step-8"]


def _sharing(shared: Path, model: torch.nn.Module, replica: int, writes: bool, **fields: Any):
    """A manager of replica group ``replica`` in the shared layout, its data position a counter."""
    manager = _manager(shared / "unused", model, **fields)
    position = _Counter()
    manager.states["dataloader"] = position
    manager.share(shared, replica, lambda: writes)
    return manager, position


def test_shared_checkpoints_have_one_writer_and_every_group_keeps_its_data_position(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, one_rank: None
) -> None:
    """torchtitan's fault-tolerant layout: the writer's full checkpoint appears whole under its
    step name, each group's data position beside it; a second writer of the same step (a split
    brain) keeps nothing of its own; a load takes the shared state and this group's position."""
    model = torch.nn.Linear(4, 4)
    writer, writer_at = _sharing(tmp_path, model, 0, writes=True)
    other, other_at = _sharing(tmp_path, model, 1, writes=False)
    writer_at.n.fill_(10.0)
    other_at.n.fill_(11.0)
    assert writer.save(1) and other.save(1)  # the other reports the writer's checkpoint
    saved = model.weight.clone()
    verify_checkpoint(tmp_path / "step-1")
    for replica in (0, 1):
        verify_checkpoint(tmp_path / f"ft-replica-{replica}" / "step-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ft-replica-0", "ft-replica-1", "step-1"]  # fmt: skip
    manifest = (tmp_path / "step-1" / CHECKSUMS).read_text()

    with torch.no_grad():
        model.weight.add_(1.0)
    rival, _ = _sharing(tmp_path, model, 2, writes=True)  # a group cut off from the others
    with caplog.at_level(logging.ERROR):
        assert rival.save(1)
    assert (tmp_path / "step-1" / CHECKSUMS).read_text() == manifest  # the first copy stayed
    assert not list(tmp_path.glob("writing-*"))
    assert "this group's copy of step 1 is discarded" in caplog.text

    other_at.n.fill_(0.0)
    assert other.load()
    assert torch.equal(model.weight, saved) and float(other_at.n) == 11.0
    assert other.data_position_missing is None
    for path in (tmp_path / "ft-replica-1" / "step-1").iterdir():
        path.unlink()
    other_at.n.fill_(0.0)
    assert other.load(step=1)
    assert other.data_position_missing == 1 and float(other_at.n) == 0.0
    for manager in (writer, other, rival):
        manager.close()


def test_an_asynchronous_shared_save_takes_its_step_name_once_sealed(
    tmp_path: Path, one_rank: None
) -> None:
    """Asynchronous: whole or absent, as a synchronous one; what a killed writer left of an
    earlier step goes at the next seal; the data positions are kept as the checkpoints are
    (``keep_latest_k``)."""
    model = torch.nn.Linear(4, 4)
    writer, _ = _sharing(tmp_path, model, 0, writes=True, async_mode="async", keep_latest_k=2)
    (tmp_path / "writing-0-r1" / "stale").mkdir(parents=True)  # a writer killed mid-save
    assert writer.save(1)
    assert not (tmp_path / "step-1").exists()  # in flight, under its writing name
    assert writer.save(2) and writer.save(3)
    writer.close()  # waits and seals
    verify_checkpoint(tmp_path / "step-3")
    assert not list(tmp_path.glob("writing-*"))
    assert sorted(p.name for p in (tmp_path / "ft-replica-0").iterdir()) == ["step-2", "step-3"]
