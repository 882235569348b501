"""torchtitan's checkpoint manager, plus a checksum manifest beside every finished save, verified
loads, and the ``config.json`` of a last save in Hugging Face format."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.tools.logging import logger

from .run_folder import (
    CHECKSUMS,
    newest_verified_checkpoint,
    verify_checkpoint,
    write_checksums,
)

__all__ = ["ChecksummedCheckpointManager"]


class ChecksummedCheckpointManager(CheckpointManager):
    """Saves as torchtitan's DCP manager does; once a save has finished (every rank's files and
    the ``.metadata`` written) the ranks record their SHA-256 in the step folder
    (:func:`~ttnpu.trainer.run_folder.write_checksums`). An asynchronous save gets its manifest
    when torchtitan has waited on it: at the next save, or at :meth:`close`. Loads are verified:
    the newest step is the newest checkpoint that verifies (each skipped one is logged with why),
    an explicit ``load_step`` that does not verify is refused, and when none verifies the load
    raises :class:`~ttnpu.trainer.run_folder.CheckpointError` before anything changes. A last save
    in Hugging Face format (``--checkpoint.last_save_in_hf``) gets the model's ``config.json`` from
    the state-dict adapter (``hf_config()``), so transformers loads the folder as it is.
    :meth:`save_now` writes a full, resumable checkpoint off the interval (a stop by signal)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        allow_unverified: bool = False
        """Load checkpoints that have no SHA-256 manifest (ttnpu-sha256.json), e.g. ones written by
        plain torchtitan, after the structural checks only; without it they are skipped."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.allow_unverified = config.allow_unverified
        self._unsealed: Path | None = None  # an asynchronous save not known to be finished
        self._now = False

    def save_now(self, curr_step: int) -> bool:
        """A full checkpoint of ``curr_step`` whatever the interval: resumable, unlike a
        ``last_step`` save (model-only or Hugging Face format by default), and sealed with its
        manifest once finished. False when checkpointing is off."""
        self._now = True
        try:
            return self.save(curr_step)
        finally:
            self._now = False

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._now:
            return not self.load_only
        return super()._should_save(curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)  # waits for an earlier asynchronous save
        if not saved:
            return False
        folder = Path(self._create_checkpoint_id(curr_step))
        hf_config = getattr(self.sd_adapter, "hf_config", None)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if last_step and self.last_save_in_hf and hf_config is not None and rank0:
            partial = folder / "config.json.partial"
            partial.write_text(json.dumps(hf_config(), indent=2, sort_keys=True))
            os.replace(partial, folder / "config.json")
        if self.save_future is None:  # finished here
            write_checksums(folder)
        else:
            self._unsealed = folder
        return True

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        if self._unsealed is not None:
            write_checksums(self._unsealed)
            self._unsealed = None

    def _close(self) -> None:
        self.maybe_wait_for_saving()  # torchtitan's close does not wait: seal the last async save
        super()._close()

    def _load(self, step: int = -1) -> bool:
        if step == -1 and self._find_load_step() == -1:  # no checkpoint: a fresh or initial load
            return super()._load(step)
        folder = Path(self.folder)
        if step != -1:
            verify_checkpoint(folder / f"step-{step}", allow_unverified=self.allow_unverified)
            return super()._load(step)
        chosen = newest_verified_checkpoint(folder, allow_unverified=self.allow_unverified)
        for path, reason in chosen.skipped:
            logger.warning(f"checkpoint {path} skipped: {reason}")
        verdict = "verifies"
        if not (chosen.path / CHECKSUMS).is_file():
            verdict = f"is unverified (no {CHECKSUMS}), allowed by --checkpoint.allow_unverified"
        log = logger.warning if chosen.skipped else logger.info
        log(f"resuming from step {chosen.step}: {chosen.path} {verdict}")
        return super()._load(chosen.step)
