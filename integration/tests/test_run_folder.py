"""Checkpoint checks before a resume, against real torch.distributed.checkpoint saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ttnpu.trainer import CheckpointError, newest_checkpoint, verify_checkpoint, write_checksums
from ttnpu.trainer.run_folder import CHECKSUMS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    state = {"w": torch.arange(1000, dtype=torch.float32) * step, "b": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_newest_complete_checkpoint_wins_and_an_interrupted_save_is_skipped(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    newest = _save(tmp_path, 10)
    (tmp_path / "step-12").mkdir()  # a save killed before .metadata was written
    (tmp_path / "step-12" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "notes").mkdir()
    assert newest_checkpoint(tmp_path) == newest


def test_a_truncated_data_file_is_named(tmp_path: Path) -> None:
    path = _save(tmp_path, 4)
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{data.name} is truncated \(100 bytes"):
        newest_checkpoint(tmp_path)


def test_a_missing_data_file_is_named(tmp_path: Path) -> None:
    path = _save(tmp_path, 4)
    data = next(path.glob("*.distcp"))
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"data file {data.name} is missing"):
        verify_checkpoint(path)


def test_garbage_metadata_and_empty_folders_are_clear_errors(tmp_path: Path) -> None:
    path = _save(tmp_path, 4)
    (path / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"unreadable \.metadata"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        newest_checkpoint(_empty(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        newest_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(tmp_path / "absent")


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_a_flipped_bit_is_caught_by_the_checksum_manifest(tmp_path: Path) -> None:
    path = _save(tmp_path, 6)
    write_checksums(path)
    verify_checkpoint(path)
    assert set(json.loads((path / CHECKSUMS).read_text())) == {
        p.name for p in path.iterdir() if p.name != CHECKSUMS
    }
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # same size: only the hash can tell
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{data.name} does not match its SHA-256"):
        verify_checkpoint(path)


def test_without_a_manifest_the_checks_stay_structural(tmp_path: Path) -> None:
    path = _save(tmp_path, 6)
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    verify_checkpoint(path)  # an async save's checkpoint: sizes only
