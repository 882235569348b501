"""torchtitan's checkpoint manager, plus a checksum manifest beside every synchronous save and the
``config.json`` of a last save in Hugging Face format."""

from __future__ import annotations

import json
import os
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
    background and get no manifest; their checks stay structural. A last save in Hugging Face
    format (``--checkpoint.last_save_in_hf``) gets the model's ``config.json`` from the state-dict
    adapter (``hf_config()``), so transformers loads the folder as it is."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        synchronous = last_step or self.async_mode == AsyncMode.DISABLED
        if saved and synchronous and (not dist.is_initialized() or dist.get_rank() == 0):
            folder = Path(self._create_checkpoint_id(curr_step))
            hf_config = getattr(self.sd_adapter, "hf_config", None)
            if last_step and self.last_save_in_hf and hf_config is not None:
                partial = folder / "config.json.partial"
                partial.write_text(json.dumps(hf_config(), indent=2, sort_keys=True))
                os.replace(partial, folder / "config.json")
            write_checksums(folder)
        return saved
