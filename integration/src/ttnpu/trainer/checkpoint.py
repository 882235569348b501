"""torchtitan's checkpoint manager, plus a checksum manifest beside every finished save, verified
loads, the ``config.json`` of a last save in Hugging Face format, and the single-writer layout of
replica groups that share their checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import DATALOADER, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from .run_folder import (
    CHECKSUMS,
    newest_verified_checkpoint,
    step_of,
    unverified_reason,
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
    :meth:`save_now` writes a full, resumable checkpoint off the interval (a stop by signal).

    :meth:`share` switches to the layout of torchtitan's fault-tolerant checkpointing, for replica
    groups that reach one folder: one group writes each full checkpoint there (model, optimizer,
    LR schedule, training state), every group its own data position into ``ft-replica-<id>/``
    beside them, so a Flash run stores one copy of its terabytes, not one per group. The writer
    writes into a ``writing-<step>-r<id>`` folder and renames it to ``step-<step>`` once sealed,
    so a checkpoint appears whole or not at all (what a writer killed mid-save leaves is deleted
    at the next seal), and of two groups that both wrote a step (a split brain, or a stop with no
    quorum to pick the writer) the first keeps its copy and the other discards its own. A load
    takes the shared checkpoint and this group's data position of the same step; where that is
    missing or does not verify, ``data_position_missing`` says so and the data position is left
    at the start for the caller to move."""

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
        self._data_folder: Path | None = None  # shared layout: this group's data positions
        self._replica_id = 0
        self._writes: Callable[[], bool] = lambda: True
        self._writing: tuple[int, Path] | None = None  # (step, folder) of the save in progress
        self.data_position_missing: int | None = None
        """Set by a shared-layout load: the step whose data position this group lacks."""

    def share(self, folder: Path, replica_id: int, writes: Callable[[], bool]) -> None:
        """Checkpoint into ``folder``, shared with the other replica groups: full checkpoints
        when ``writes()`` (asked at each save: the quorum's participating rank 0), this group's
        data position always."""
        self.folder = str(folder)
        self._data_folder = folder / f"ft-replica-{replica_id}"
        self._replica_id = replica_id
        self._writes = writes

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if self._writing is not None and not folder and step == self._writing[0]:
            return str(self._writing[1])  # the writer's save goes to its own folder first
        return super()._create_checkpoint_id(step, folder)

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
        if self._data_folder is None:
            return self._save_full(curr_step, last_step)
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        position = Path(self._create_checkpoint_id(curr_step, folder=str(self._data_folder)))
        self.dcp_save(
            {DATALOADER: self.states[DATALOADER]},
            checkpoint_id=str(position),
            async_mode=AsyncMode.DISABLED,
        )
        write_checksums(position)
        self._purge_data_positions()
        if not self._writes():
            logger.info(f"step {curr_step}: data position saved; another group writes the rest")
            return True  # this step's checkpoint is the shared one
        self._writing = (curr_step, Path(self.folder) / f"writing-{curr_step}-r{self._replica_id}")
        try:
            return self._save_full(curr_step, last_step)
        finally:
            self._writing = None

    def _purge_data_positions(self) -> None:
        """Keep this group's ``keep_latest_k`` newest data positions, as torchtitan keeps the
        newest checkpoints (a Flash group writes one file per rank each time)."""
        if self._data_folder is None or self.keep_latest_k <= 0:
            return
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        steps = sorted((s, p) for p in self._data_folder.iterdir() if (s := step_of(p)) is not None)
        for _, path in steps[: -self.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    def _save_full(self, curr_step: int, last_step: bool) -> bool:
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
            self._seal(folder)
        else:
            self._unsealed = folder
        return True

    def _seal(self, folder: Path) -> None:
        """The manifest of a finished save; a shared-layout writer's folder then takes its step
        name, unless another group's copy holds it already (that one stays). What a writer that
        died mid-save left of an earlier step goes."""
        write_checksums(folder)
        step = _writing_step(folder)
        if step is None:
            return
        final = folder.with_name(f"step-{step}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                folder.rename(final)
            except OSError:
                logger.error(
                    f"{final} was written by another replica group (a split brain, or a stop "
                    f"without a quorum); this group's copy of step {step} is discarded"
                )
                shutil.rmtree(folder, ignore_errors=True)
            for stale in folder.parent.glob("writing-*"):
                if (earlier := _writing_step(stale)) is not None and earlier < step:
                    shutil.rmtree(stale, ignore_errors=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank goes on before the step has its name

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        if self._unsealed is not None:
            self._seal(self._unsealed)
            self._unsealed = None

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        states = super()._states_to_load(model_only)
        if self._data_folder is not None:
            states.pop(DATALOADER, None)  # the writer's; this group's is its own
        return states

    def _close(self) -> None:
        self.maybe_wait_for_saving()  # torchtitan's close does not wait: seal the last async save
        super()._close()

    @property
    def data_folder(self) -> Path | None:
        """Shared layout: where this group's data positions are (a rollback discards there too)."""
        return self._data_folder

    def _load(self, step: int = -1) -> bool:
        if step == -1 and self._find_load_step() == -1:  # no checkpoint: a fresh or initial load
            return super()._load(step)
        folder = Path(self.folder)
        if step != -1:
            verify_checkpoint(folder / f"step-{step}", allow_unverified=self.allow_unverified)
        else:
            chosen = newest_verified_checkpoint(folder, allow_unverified=self.allow_unverified)
            for path, reason in chosen.skipped:
                logger.warning(f"checkpoint {path} skipped: {reason}")
            verdict = "verifies"
            if not (chosen.path / CHECKSUMS).is_file():
                verdict = (
                    f"is unverified (no {CHECKSUMS}), allowed by --checkpoint.allow_unverified"
                )
            log = logger.warning if chosen.skipped else logger.info
            log(f"resuming from step {chosen.step}: {chosen.path} {verdict}")
            step = chosen.step
        loaded = super()._load(step)
        self._load_data_position(step)
        return loaded

    def _load_data_position(self, step: int) -> None:
        """Shared layout: this group's data position of ``step``, or ``data_position_missing``."""
        self.data_position_missing = None
        if self._data_folder is None:
            return
        position = self._data_folder / f"step-{step}"
        reason = unverified_reason(position, allow_unverified=self.allow_unverified)
        if reason is not None:
            logger.warning(f"no data position of step {step} for this replica group: {reason}")
            self.data_position_missing = step
            return
        self.dcp_load(
            {DATALOADER: self.states[DATALOADER]},
            checkpoint_id=str(position),
            from_hf=False,
            from_quantized=False,
        )


def _writing_step(folder: Path) -> int | None:
    """N for a shared-layout writer's folder ``writing-N-r<id>``, else None."""
    name = folder.name.split("-")
    return int(name[1]) if len(name) == 3 and name[0] == "writing" else None
