"""Which of a run folder's checkpoints may be loaded: the newest one that verifies.

torchtitan writes a checkpoint as ``checkpoint/step-N/`` with torch.distributed.checkpoint (DCP),
whose ``.metadata`` file is written last: a save killed midway leaves a folder without it. DCP keeps
no checksums, so a truncated or deleted data file surfaces deep inside the restore and flipped bits
load silently. :func:`write_checksums` records a SHA-256 manifest (``ttnpu-sha256.json``) once a
save has finished; a checkpoint *verifies* when its metadata reads, every byte range it references
exists, and every file matches the manifest. One without a manifest is unverified: skipped unless
the caller allows unverified checkpoints (then only the structural checks apply).
:func:`newest_verified_checkpoint` walks the checkpoints newest first, so a resume or a rollback
falls back past a corrupt one and says which it skipped and why.

A Flash checkpoint is terabytes across 128 ranks: hashing all of it on every rank would take
hours. Each rank therefore hashes only its share of the files (every ``world``-th of the sorted
names from its rank on; ``.metadata`` sorts first, to rank 0) and the ranks agree on one verdict
(an all-gather of their reasons) once torch.distributed is up. Before that (the ``--resume``
pre-check of ``ttnpu-train``) each process judges the share ``RANK``/``WORLD_SIZE`` give it, and the
load decides together. One process alone checks everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHECKSUMS",
    "CheckpointError",
    "VerifiedCheckpoint",
    "newest_verified_checkpoint",
    "step_of",
    "unverified_reason",
    "verify_checkpoint",
    "write_checksums",
]

_STEP = re.compile(r"step-(\d+)")
CHECKSUMS = "ttnpu-sha256.json"
"""The manifest file in a checkpoint folder: ``{file name: sha256 hex}``."""


class CheckpointError(Exception):
    """A checkpoint to load is missing, incomplete, corrupt or unverified."""


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """The checkpoint a load may use, and every newer one passed over with why."""

    path: Path
    step: int
    skipped: tuple[tuple[Path, str], ...] = ()


def newest_verified_checkpoint(
    folder: Path, *, allow_unverified: bool = False
) -> VerifiedCheckpoint:
    """The newest ``step-N`` checkpoint under ``folder`` that verifies (collective: every rank
    calls it). Raises :class:`CheckpointError` naming every skipped one when none does."""
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint folder {folder}")
    candidates = sorted(
        ((step, p) for p in folder.iterdir() if (step := step_of(p)) is not None and p.is_dir()),
        reverse=True,
    )
    skipped: list[tuple[Path, str]] = []
    for step, path in candidates:
        reason = unverified_reason(path, allow_unverified=allow_unverified)
        if reason is None:
            return VerifiedCheckpoint(path, step, tuple(skipped))
        skipped.append((path, reason))
    found = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "there is none"
    raise CheckpointError(f"no checkpoint in {folder} verifies ({found})")


def verify_checkpoint(path: Path, *, allow_unverified: bool = False) -> None:
    """Raise :class:`CheckpointError` unless ``path`` verifies (collective, as above)."""
    reason = unverified_reason(path, allow_unverified=allow_unverified)
    if reason is not None:
        raise CheckpointError(f"checkpoint {path}: {reason}")


def unverified_reason(path: Path, *, allow_unverified: bool = False) -> str | None:
    """Why ``path`` does not verify, the same answer on every rank; None when it does."""
    rank, world = _share()
    try:
        reason = _local_reason(path, allow_unverified, rank, world)
    except OSError as err:  # a reason, not an exception: every rank must reach the agreement
        reason = f"unreadable ({err})"
    return _agreed(reason)


def _local_reason(path: Path, allow_unverified: bool, rank: int, world: int) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader  # torch: only when checking

    if not (path / ".metadata").is_file():
        return "incomplete (no .metadata: a save that did not finish, or not a DCP checkpoint)"
    expected: dict[str, str] | None = None
    if (path / CHECKSUMS).is_file():
        try:
            expected = dict(json.loads((path / CHECKSUMS).read_text()))
        except (ValueError, TypeError) as err:
            return f"unreadable {CHECKSUMS} ({err})"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # unpickling garbage raises anything
        return f"unreadable .metadata ({err!r})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    if not needed:
        return ".metadata references no data files"
    for name in sorted({".metadata", *needed, *(expected or {})})[rank::world]:
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        size = file.stat().st_size
        if size < needed.get(name, 0):
            return f"data file {name} is truncated ({size} bytes, needs {needed[name]})"
        if expected is None:
            continue
        if name not in expected:
            return f"file {name} is not in {CHECKSUMS}"
        if _sha256(file) != expected[name]:
            return f"file {name} does not match its SHA-256 (corrupt)"
    if expected is None and not allow_unverified:
        return f"unverified (no {CHECKSUMS}; --checkpoint.allow_unverified accepts it)"
    return None


def write_checksums(path: Path) -> None:
    """Record the SHA-256 of every file of the finished checkpoint ``path``: each rank hashes its
    share, rank 0 writes the manifest atomically (whole or absent). Collective under
    torch.distributed (it returns once the manifest is written); call it only once every rank's
    files are written."""
    rank, world = _share()
    names = sorted(
        p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(CHECKSUMS)
    )
    digests = _gathered({name: _sha256(path / name) for name in names[rank::world]}, world)
    if rank == 0:  # a file another rank did not list yet (config.json of a last save) is hashed
        digests.update({name: _sha256(path / name) for name in names if name not in digests})
        partial = path / f"{CHECKSUMS}.partial"
        partial.write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
        os.replace(partial, path / CHECKSUMS)
    if _distributed():  # no rank goes on before the manifest is there
        import torch.distributed as dist

        dist.barrier()


def _share() -> tuple[int, int]:
    """This process's rank and world: torch.distributed's once it is up, else the launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agreed(reason: str | None) -> str | None:
    """The first rank's reason, on every rank (just ``reason`` before torch.distributed is up)."""
    if not _distributed():
        return reason
    import torch.distributed as dist

    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


def _gathered(digests: dict[str, str], world: int) -> dict[str, str]:
    """Every rank's share of the digests, merged."""
    if world == 1:
        return digests
    if not _distributed():
        raise RuntimeError(f"write_checksums with WORLD_SIZE {world} needs torch.distributed")
    import torch.distributed as dist

    shares: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(shares, digests)
    return {name: digest for share in shares for name, digest in (share or {}).items()}


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
