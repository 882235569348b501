"""torchtitan's checkpoint manager, plus a checksum manifest beside every synchronous save."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

from .run_folder import write_checksums

__all__ = ["ChecksummedCheckpointManager"]


class ChecksummedCheckpointManager(CheckpointManager):
    """Saves and loads exactly as torchtitan's DCP manager; once a save has finished (every
    rank's files and the ``.metadata`` written), rank 0 records their SHA-256 in the step folder,
    so a resume can tell a corrupted file from a good one. Asynchronous saves finish in the
    background and get no manifest; their checks stay structural."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        synchronous = last_step or self.async_mode == AsyncMode.DISABLED
        if saved and synchronous and (not dist.is_initialized() or dist.get_rank() == 0):
            write_checksums(Path(self._create_checkpoint_id(curr_step)))
        return saved
