"""Checks on a run folder's checkpoints before a resume touches anything.

torchtitan writes a checkpoint as ``checkpoint/step-N/`` with torch.distributed.checkpoint (DCP),
whose ``.metadata`` file is written last: a save killed midway leaves a folder without it, which
torchtitan's loader skips, so the previous checkpoint stays the newest complete one. What the
loader does not check is that the files of that newest checkpoint are intact: a truncated or
deleted data file surfaces deep inside the restore, and flipped bits load silently (DCP keeps no
checksums). :func:`write_checksums` records a SHA-256 manifest beside a finished save;
:func:`newest_checkpoint` reads the metadata, checks every byte range it references and, where the
manifest exists, every file's hash, so a resume fails up front, naming the file, with nothing
changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

__all__ = [
    "CHECKSUMS",
    "CheckpointError",
    "newest_checkpoint",
    "step_of",
    "verify_checkpoint",
    "write_checksums",
]

_STEP = re.compile(r"step-(\d+)")
CHECKSUMS = "ttnpu-sha256.json"
"""The manifest file in a checkpoint folder: ``{file name: sha256 hex}``."""


class CheckpointError(Exception):
    """A checkpoint to resume from is missing, incomplete or corrupt."""


def verify_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete, readable DCP checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader  # torch: only when checking

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no .metadata)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # unpickling garbage raises anything
        raise CheckpointError(f"checkpoint {path}: unreadable .metadata ({err!r})") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    if not needed:
        raise CheckpointError(f"checkpoint {path}: .metadata references no data files")
    for name, end in sorted(needed.items()):
        data = path / name
        if not data.is_file():
            raise CheckpointError(f"checkpoint {path}: data file {name} is missing")
        size = data.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint {path}: data file {name} is truncated ({size} bytes, needs {end})"
            )
    manifest = path / CHECKSUMS
    if manifest.is_file():
        try:
            expected = json.loads(manifest.read_text())
        except ValueError as err:
            raise CheckpointError(f"checkpoint {path}: unreadable {CHECKSUMS} ({err})") from err
        for name, digest in sorted(expected.items()):
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path}: file {name} is missing")
            if _sha256(path / name) != digest:
                raise CheckpointError(
                    f"checkpoint {path}: file {name} does not match its SHA-256 (corrupt)"
                )


def write_checksums(path: Path) -> None:
    """Record the SHA-256 of every file of the finished checkpoint ``path`` (written atomically:
    a manifest is either whole or absent)."""
    digests = {
        p.name: _sha256(p) for p in sorted(path.iterdir()) if p.is_file() and p.name != CHECKSUMS
    }
    partial = path / f"{CHECKSUMS}.partial"
    partial.write_text(json.dumps(digests, indent=1) + "\n")
    os.replace(partial, path / CHECKSUMS)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def step_of(path: Path) -> int | None:
    """N for a torchtitan checkpoint folder named ``step-N``, else None."""
    match = _STEP.fullmatch(path.name)
    return int(match.group(1)) if match else None


def newest_checkpoint(folder: Path) -> Path:
    """The newest complete ``step-N`` checkpoint under ``folder``, verified."""
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint folder {folder}")
    steps = sorted(
        (step, p)
        for p in folder.iterdir()
        if (step := step_of(p)) is not None and (p / ".metadata").is_file()
    )
    if not steps:
        raise CheckpointError(f"no complete checkpoint (step-N/.metadata) in {folder}")
    newest = steps[-1][1]
    verify_checkpoint(newest)
    return newest
