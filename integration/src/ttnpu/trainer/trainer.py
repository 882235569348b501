"""torchtitan's Trainer for DeepSeek-V4, with the ttnpu libraries composed into its step.

The step loop is this module's own (torchtitan's ``train_step`` commits unconditionally); the rest
(model build, parallelisation, optimizer, LR schedule, dataloader, checkpointer, metrics) is
torchtitan's. One optimizer step:

1. its batches come from the routing schedule (:mod:`ttnpu.trainer.spikes`);
2. forward and backward run under the SDC checks (:mod:`ttnpu.trainer.sdc_guard`);
3. the stepper (:mod:`ttnpu.trainer.stepper`) decides: quorum and heal, gradients averaged over
   the replicas, a veto vote, commit; gradients are clipped and the optimizer and LR schedule move
   only on a committed step;
4. a step that was not committed is re-run on the same batches; a committed one is logged, its
   replica-averaged loss is judged for a spike (which rolls every replica back together), and it
   is checkpointed when the routing schedule allows.

A stop (:meth:`DSV4Trainer.request_stop`, from a signal handler) is agreed by every rank and
replica in a step's vote; they all stop after that committed step, each with a full checkpoint of
it (:attr:`DSV4Trainer.stopped` says how it went).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ttnpu.dsv4.ac_compile import check_options
from ttnpu.ft import LighthouseUnreachable
from ttnpu.routing import (
    AnticipatorySchedule,
    DataExhaustedError,
    NoRollbackTargetError,
    Phase,
    TrainingStep,
)

from .checkpoint import ChecksummedCheckpointManager
from .corpus import register_dataset
from .features import (
    FaultTolerance,
    PersistentSDCError,
    SilentDataCorruption,
    SpikeRecovery,
)
from .launcher import restart_count, wait_at_start_barrier
from .platform import Platform, activate, detect
from .sdc_guard import SDCGuard
from .spikes import Batch, SpikeGuard
from .steplog import StepLog
from .stepper import LocalStepper, ReplicaStepper, Stepper
from .validation import check_config

__all__ = ["Attempt", "CommittedStep", "DSV4Trainer", "Stopped", "init_optimizer_state"]


@dataclass
class Attempt:
    """One try at a step, filled in as it runs: the tokens seen when it began (torchtitan
    counts them in ``post_dataloading_process``; a discarded attempt gives them back), and the
    clipped gradient norm and learning rate of its update."""

    number: int
    tokens_before: int | None = None
    grad_norm: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))
    lr: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CommittedStep:
    """What a committed optimizer step returns: its replica-averaged loss, the clipped gradient
    norm and learning rate of the update, the tokens it trained on, how many attempts it took,
    the routing phase it trained in and torchft's share of it."""

    step: int
    phase: Phase
    loss: float
    grad_norm: float
    lr: dict[str, float]
    tokens: int
    attempts: int
    participants: int
    timings: dict[str, float]
    stop: bool = False  # every rank and replica agreed to stop after this step


@dataclass(frozen=True)
class Stopped:
    """How a training loop that was asked to stop ended: after committed step ``step``, with a
    checkpoint of it, or without one and why (anticipatory routing was not in NORMAL,
    checkpointing is off)."""

    why: str  # "SIGTERM", or who asked instead
    step: int
    checkpoint: Path | None
    no_checkpoint: str = ""

    def __str__(self) -> str:
        saved = f"checkpoint {self.checkpoint}" if self.checkpoint else self.no_checkpoint
        return f"stopped by {self.why} at step {self.step}; {saved}"


def init_optimizer_state(optimizers: OptimizersContainer) -> None:
    """Give every parameter its optimizer state now, as a fresh optimizer would hold it.

    Parameters that get no gradient (during DeepSeek-V4's dense indexer warm-up only the
    lightning indexers train, on their KL loss) would otherwise have no state in a checkpoint,
    while a restore initialises and expects state for all: resuming would fail on a missing
    key. torchtitan's ``state_dict`` creates the state with a zero-gradient, zero-lr step,
    which also counts a step; the count goes back to 0 so that the first real update has its
    full bias-corrected size (counted as step 2, AdamW's would be ~0.74x)."""
    optimizers.state_dict()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0


def _rng_states(device_type: str) -> dict[str, torch.Tensor]:
    """The default generators' states: the CPU's and the accelerator's (torch.cuda / torch.npu,
    the same call on both)."""
    states = {"cpu": torch.get_rng_state()}
    if device_type != "cpu":
        states[device_type] = torch.get_device_module(device_type).get_rng_state()
    return states


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    for device_type, state in states.items():
        if device_type == "cpu":
            torch.set_rng_state(state.cpu())
        else:
            torch.get_device_module(device_type).set_rng_state(state.cpu())


def _select_attention_backend(config: DSV4Trainer.Config, device_type: str) -> None:
    """Apply ``--attention_backend`` to the model config, refusing a backend that cannot run on
    this device before anything is built."""
    backend = config.attention_backend
    if backend == "model":
        return
    needs = {"flex": "cuda", "npu": "npu"}.get(backend)
    if needs is not None and device_type != needs:
        raise ValueError(
            f"attention_backend {backend} runs on {needs} only, and this run trains on "
            f"{device_type}; use chunked or reference"
        )
    model = config.model_spec.model
    if not hasattr(model, "overrides"):
        raise ValueError(f"attention_backend {backend}: the model is not ttnpu.dsv4's")
    model.overrides = {**model.overrides, "attention_backend": backend}


class DSV4Trainer(Trainer):
    """torchtitan's Trainer with the device from :mod:`ttnpu.trainer.platform` (cpu/gloo when
    there is no accelerator), the model's own loss (``model(tokens, labels=labels)``: next-token
    CE + MTP, balance and indexer losses), optimizer state for every parameter from the start (so
    checkpoints restore), and the step loop described in this module's docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
        """Device to train on; "auto" = the available accelerator (cuda, npu), else cpu."""

        attention_backend: Literal["model", "reference", "chunked", "flex", "npu"] = "model"
        """DeepSeek-V4's attention core (``ttnpu.dsv4.backends``): "model" = the recipe's model
        config (chunked); flex runs on cuda, npu on npu (Ascend's fused operators)."""

        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
        sdc: SilentDataCorruption = field(default_factory=SilentDataCorruption)
        spike: SpikeRecovery = field(default_factory=SpikeRecovery)

    platform: Platform
    stepper: Stepper
    checkpointer: ChecksummedCheckpointManager  # checked in __init__
    anticipation_from: int | None = None
    """The step the replicas rolled back to and started anticipatory routing from, until the
    routing is NORMAL again; part of the training state."""
    step: int  # torchtitan's, set in its __init__
    ntokens_seen: int  # torchtitan's, set in its __init__
    _progress_start: tuple[int, float] | None = None
    _stop_asked_by: str | None = None
    _heal_for_rollback: tuple[int, str] | None = None
    """After a rollback with no target here: the heal count it waits to see grow, and why."""
    _data_at_start: dict[str, Any]
    """The data position before anything was loaded: where a rollback healed from step 0 starts."""
    stopped: Stopped | None = None
    """Set when :meth:`train` ended on an agreed stop."""

    def __init__(self, config: Config) -> None:
        register_dataset()
        check_config(config)  # what ttnpu-train checks, for callers from Python too
        if config.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("DSV4Trainer does not support pipeline parallelism")
        # refused here, before the device and the model are set up; parallelize would too
        check_options(config.activation_checkpoint, config.compile)
        if config.compile.enable and "loss" in config.compile.components:
            raise ValueError(
                "compile.components 'loss' is not supported by DSV4Trainer: it trains on the "
                "model's own loss (DeepSeekV4.loss: CE + MTP, balance and indexer terms), not on "
                "torchtitan's loss function; use --compile.components model"
            )
        if config.sdc.inject_kind == "allreduce" and not config.fault_tolerance.enable:
            raise ValueError(
                "sdc.inject_kind allreduce needs fault_tolerance.enable: the all-reduce that is "
                "checked is the one across replica groups"
            )
        if config.fault_tolerance.checkpoint_folder and not config.fault_tolerance.enable:
            raise ValueError(
                "fault_tolerance.checkpoint_folder needs fault_tolerance.enable (it is where "
                "replica groups share their checkpoints)"
            )
        self.platform = activate(detect(config.device))
        _select_attention_backend(config, self.platform.device_type)
        super().__init__(config)
        if not isinstance(self.checkpointer, ChecksummedCheckpointManager):
            raise ValueError(
                "DSV4Trainer checkpoints with ttnpu's manager (checkpoint = "
                "ChecksummedCheckpointManager.Config(...)), not torchtitan's plain one"
            )
        init_optimizer_state(self.optimizers)
        ft = config.fault_tolerance
        if ft.enable and ft.replicas > 1:
            self._shard_data_over_replicas(ft)
        model = self.model_parts[0]
        self.replica_id = ft.replica_id if ft.enable else 0
        run = Path(config.dump_folder)
        self.step_log = StepLog(run / "steps.jsonl", enabled=torch.distributed.get_rank() == 0)
        self.sdc = (
            SDCGuard(
                config.sdc,
                model,
                replica_id=self.replica_id,
                rank=self.replica_id * torch.distributed.get_world_size()
                + torch.distributed.get_rank(),
                events_path=run / "sdc_events.jsonl",
            )
            if config.sdc.enable
            else None
        )
        self.spikes = SpikeGuard(
            config.spike, model, self._capture_forward, self.gradient_accumulation_steps
        )
        self.stepper = (
            ReplicaStepper(
                ft,
                model,
                self.optimizers,
                self.lr_schedulers,
                train_state=self,
                device=self.platform.device_type,
                reduction_check=self.sdc.reduction_check(ft.replicas) if self.sdc else None,
            )
            if ft.enable
            else LocalStepper(model, self.optimizers, self.lr_schedulers)
        )
        if self.sdc is not None:
            self.sdc.veto_through(self.stepper.raise_flag)
        shared = ft.shared_checkpoints(run)
        if shared is not None and isinstance(self.stepper, ReplicaStepper):  # enable: checked
            self.checkpointer.share(shared, ft.replica_id, self.stepper.writes_checkpoints)
        if ft.enable and ft.start_barrier:
            wait_at_start_barrier(
                Path(ft.start_barrier), ft.replica_id, ft.replicas, ft.quorum_timeout_seconds
            )

    # -- the training state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The training state beside the model, optimizer, LR schedule and data position, the one
        thing checkpoints, resumes, heals and rollbacks all restore (torchtitan registers the
        trainer as the checkpoint's ``train_state``; ttnpu-ft sends it in a heal): torchtitan's
        step and tokens seen, the loss-spike detector (so a replica that healed judges the next
        loss as the others do and rolls back with them), the step anticipatory routing started
        from (so a replica that healed routes in the others' phase) and the RNG states (so
        torchtitan's ``--debug.seed`` holds across them)."""
        return {
            **super().state_dict(),
            "spike_detector": self.spikes.detector.state_dict(),
            "anticipation_from": self.anticipation_from,
            "rng": _rng_states(self.platform.device_type),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spikes.detector.load_state_dict(state_dict["spike_detector"])
        self.anticipation_from = state_dict["anticipation_from"]
        _set_rng_states(state_dict["rng"])
        super().load_state_dict(state_dict)

    def _shard_data_over_replicas(self, ft: FaultTolerance) -> None:
        """One data shard per replica group (and per data-parallel rank inside it)."""
        degree, rank = 1, 0
        if self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            degree, rank = mesh.size(), mesh.get_local_rank()
        self.dataloader = self.config.dataloader.build(
            dp_world_size=degree * ft.replicas,
            dp_rank=ft.replica_id * degree + rank,
            tokenizer=self.tokenizer,
            seq_len=self.config.training.seq_len,
            local_batch_size=self.config.training.local_batch_size,
        )
        self.checkpointer.states["dataloader"] = self.dataloader

    # -- the step --------------------------------------------------------------------------------
    def _capture_forward(self, batch: Batch) -> object:
        """The forward that anticipatory routing runs to capture a batch's expert choices: the
        training forward (with labels, so the MTP modules' routers run too)."""
        input_dict, labels = batch
        return self.model_parts[0](
            input_dict["input"].to(self.device), labels=labels.to(self.device)
        )

    def _forward_backward(self, planned: TrainingStep[Batch], attempt: Attempt) -> torch.Tensor:
        """Every micro-batch of the step (under route replay and the SDC checks); returns the
        step's mean loss over this replica's valid tokens. A detection vetoes the step on every
        replica as it is reported (``SDCGuard.veto_through``)."""
        if self._heal_for_rollback is not None and self.stepper.heals == self._heal_for_rollback[0]:
            raise NoRollbackTargetError(
                f"replica {self.replica_id}: no replica in the quorum holds a rollback target "
                f"(here: {self._heal_for_rollback[1]})"
            )
        step = self.step + 1  # after the quorum: a heal has set self.step
        attempt.tokens_before = self.ntokens_seen  # (a heal has set that too)
        self.spikes.maybe_inject(step)
        valid = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in planned.microbatches)
        global_valid = torch.tensor(valid, device=self.device)
        if self.parallel_dims.dp_enabled:
            global_valid = dist_utils.dist_sum_tensor(
                global_valid, self.parallel_dims.get_mesh("batch")
            )
        loss = torch.zeros((), device=self.device)
        watch = self.sdc.watch(step, attempt.number) if self.sdc is not None else nullcontext()
        with watch:
            last = len(planned.microbatches) - 1
            for i, (input_dict, labels) in enumerate(planned.microbatches):
                inputs = {k: v.to(self.device) for k, v in input_dict.items()}
                accumulating = self.stepper.no_sync() if i < last else nullcontext()
                with planned.replay(i), accumulating:
                    part = self.forward_backward_step(
                        input_dict=inputs,
                        labels=labels.to(self.device),
                        global_valid_tokens=global_valid,
                    )
                loss += part.detach()
        if self.parallel_dims.dp_cp_enabled:
            loss = torch.tensor(
                dist_utils.dist_sum(loss, self.parallel_dims.get_optional_mesh("loss")),
                device=self.device,
            )
        if self.sdc is not None:
            self.sdc.after_backward(attempt.number, loss)
        return loss

    def _before_update(self, attempt: Attempt) -> None:
        """On the committed, replica-averaged gradients: clip, as torchtitan does; note the
        learning rate this update uses (after any heal)."""
        attempt.lr = self.lr_schedulers.get_metrics()
        attempt.grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=None,
            ep_enabled=self.parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()

    def _commit(self, planned: TrainingStep[Batch]) -> CommittedStep:
        """Run the step until it commits: a discarded attempt (veto, lost peer) changes nothing
        and is re-run on the same batches; a re-run corrupted again ends this replica."""
        limit = self.config.fault_tolerance.max_attempts
        heals = self.stepper.heals
        for number in range(1, limit + 1):
            attempt = Attempt(number)
            try:
                outcome = self.stepper.run(
                    partial(self._forward_backward, planned, attempt),
                    partial(self._before_update, attempt),
                    stop=self._stop_asked_by is not None,
                )
            except Exception:
                if attempt.tokens_before is not None:  # ended inside its forward: not trained on
                    self.ntokens_seen = attempt.tokens_before
                raise
            events = self.sdc.take_events() if self.sdc is not None else []
            if self.stepper.heals > heals:
                heals = self.stepper.heals
                self._log_heal()
            if attempt.tokens_before is None:  # discarded before its forward (quorum failed)
                tokens = 0
            else:
                tokens = self.ntokens_seen - attempt.tokens_before
            if outcome.committed:
                self.metrics_processor.ntokens_since_last_log += tokens
                assert outcome.loss is not None
                return CommittedStep(
                    step=self.step + 1, phase=planned.phase, loss=float(outcome.loss),
                    grad_norm=float(attempt.grad_norm), lr=attempt.lr, tokens=tokens,
                    attempts=number, participants=outcome.participants,
                    timings=outcome.timings, stop=outcome.stop,
                )  # fmt: skip
            self.ntokens_seen -= tokens  # the attempt's tokens were not trained on
            self.step_log.write(
                event="discarded", step=self.step + 1, attempt=number,
                vetoed=outcome.vetoed, recovered=outcome.recovered, healing=outcome.healing,
                sdc_events=len(events),
                replica=self.replica_id,
            )  # fmt: skip
            if number > 1 and SDCGuard.corrupted(events):
                raise PersistentSDCError(
                    f"replica {self.replica_id}: step {self.step + 1} was corrupted again when "
                    f"re-run (attempt {number}); the fault is persistent"
                )
        raise RuntimeError(
            f"step {self.step + 1} was discarded {limit} times in a row "
            f"(fault_tolerance.max_attempts); giving up"
        )

    def _log_heal(self) -> None:
        self._heal_for_rollback = None
        self.step_log.supersede_after(self.step)  # a heal after a rollback to step 0 goes back
        moved = {}
        if isinstance(self.stepper, ReplicaStepper):
            replica = self.stepper.replica
            moved = {"bytes": replica.last_heal_bytes, "restore_seconds": replica.last_heal_seconds}
        self.step_log.write(event="heal", step=self.step, replica=self.replica_id, **moved)

    def _roll_back(self, onset: int) -> AnticipatorySchedule[Batch]:
        """Restore the newest verified checkpoint before ``onset`` and start anticipatory routing.

        Under fault tolerance the target is agreed at the next quorum: torchft heals every
        replica behind the highest step to it, so the replicas continue from the newest target
        any of them holds. A replica that holds none (it joined after the target was written,
        or its copies are corrupt) goes back to step 0 and the start of its data, and is healed
        there; if no replica held one, its next step raises ``NoRollbackTargetError``."""
        self.checkpointer.maybe_wait_for_saving()  # one in flight would land after the discard
        folder = Path(self.checkpointer.folder)
        allow = getattr(self.config.checkpoint, "allow_unverified", False)
        spiked_at = self.step
        try:
            plan = self.spikes.plan(folder, onset, allow_unverified=allow)
        except NoRollbackTargetError as missing:
            if not isinstance(self.stepper, ReplicaStepper):
                raise
            self.dataloader.load_state_dict(self._data_at_start)
            self.step = 0
            self._heal_for_rollback = (self.stepper.heals, str(missing))
        else:
            self.checkpointer.load(step=plan.target.step)
            if self.checkpointer.data_position_missing is not None:
                self.dataloader.load_state_dict(self._data_at_start)  # caught up below
            self.step_log.supersede_after(self.step)
        self.stepper.set_step(self.step)
        discarded = self.spikes.discard_from(folder, onset)
        if (positions := self.checkpointer.data_folder) is not None:
            discarded += self.spikes.discard_from(positions, onset)
        self.spikes.detector.reset()
        schedule = self.spikes.schedule(self.dataloader, self.step)
        if self._heal_for_rollback is None and self.checkpointer.data_position_missing is not None:
            self._catch_up_data(schedule, self.step)
        spike = f"loss spike (onset step {onset}, seen at step {spiked_at})"
        if self._heal_for_rollback is not None:  # the heal brings the others' routing phase
            logger.warning(f"{spike}: no rollback target here, healing from a replica that has one")
        else:
            if self.config.spike.anticipatory:
                schedule.trigger()
                self.anticipation_from = self.step
            logger.warning(
                f"{spike}: rolled back to step {self.step}; routing phase {schedule.phase.name}"
            )
        self.step_log.write(
            event="rollback", onset=onset, detected_at=spiked_at, step=self.step,
            discarded=[str(p) for p in discarded], replica=self.replica_id,
            healing=self._heal_for_rollback is not None,
        )  # fmt: skip
        return schedule

    def commit_step(self, schedule: AnticipatorySchedule[Batch]) -> CommittedStep:
        """One committed optimizer step on the next batches of ``schedule``. Raises
        ``DataExhaustedError`` when the data ends."""
        loaded = time.perf_counter()
        if schedule.phase is Phase.WARMUP:  # capture the routes of the next Δt steps
            schedule.warm_up()
            self.step_log.write(event="warmup", step=self.step, captured=schedule.queued_steps)
        planned = schedule.next_step()
        self.metrics_processor.data_loading_times.append(time.perf_counter() - loaded)
        own_step, heals = self.step, self.stepper.heals
        done = self._commit(planned)
        schedule.finish_step()
        self.step += 1
        if self.stepper.heals > heals:
            self._join_peers(schedule, self.step - 1 - own_step)
        if schedule.phase is Phase.NORMAL:
            self.anticipation_from = None
        return done

    def _join_peers(self, schedule: AnticipatorySchedule[Batch], steps: int) -> None:
        """After a heal moved this replica from its own step to a live one's: its data shard
        moves as far (a replica's shard position is a function of the step, ``microbatches``
        batches a step, so a rejoined replica does not train again on batches it trained on
        before), and its routing schedule takes up the phase the live ones are in (the heal
        brought ``anticipation_from``), so the replicas route alike and checkpoint at the same
        steps."""
        schedule.step = self.step
        self._catch_up_data(schedule, steps)
        if self.anticipation_from is None:
            schedule.abandon_step()
        else:
            schedule.follow(self.anticipation_from)

    def _catch_up_data(self, schedule: AnticipatorySchedule[Batch], steps: int) -> None:
        """Move this replica's data shard ``steps`` optimizer steps ahead, ``microbatches``
        batches a step (after a heal; after a load that had no data position of this group)."""
        batches = max(steps, 0) * self.gradient_accumulation_steps
        for skipped in range(batches):
            if next(schedule.data, None) is None:
                raise DataExhaustedError(
                    f"data ended {skipped} batches into a catch-up of {batches}"
                )
        if batches:
            self.step_log.write(event="data_catch_up", step=self.step, batches=batches)

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        """torchtitan's step commits unconditionally; this trainer's step is :meth:`commit_step`
        (batches from a routing schedule, the stepper's commit decision)."""
        raise TypeError("DSV4Trainer steps with commit_step(schedule), not train_step(iterator)")

    # -- the loop --------------------------------------------------------------------------------
    def train(self) -> None:
        config = self.config
        self._data_at_start = self.dataloader.state_dict()
        checkpointed = self.step if self.checkpointer.load(step=config.checkpoint.load_step) else -1
        self.stepper.set_step(self.step)
        loaded_step = self.step
        logger.info(f"Training starts at step {self.step + 1}")
        superseded = self.step_log.supersede_after(self.step)
        self.step_log.write(
            event="start",
            step=self.step,
            replica=self.replica_id,
            superseded=superseded,
            restart=restart_count(),  # > 0: torchelastic restarted this replica
            pid=os.getpid(),
        )
        schedule = self.spikes.schedule(self.dataloader, self.step)
        if self.checkpointer.data_position_missing is not None:
            self._catch_up_data(schedule, self.step)
        with config.profiler.build(
            global_step=self.step, base_folder=config.dump_folder
        ) as profiler:
            while self.step < config.training.steps:
                self.gc_handler.run(self.step + 1)
                try:
                    done = self.commit_step(schedule)
                except DataExhaustedError:
                    logger.warning("Ran out of data; stopping.")
                    break
                except LighthouseUnreachable:
                    # No step can start: keep what was committed (a checkpoint written now counts
                    # the batches drawn for the step that could not start as read).
                    lost = "a lost Lighthouse"
                    self.stopped = self._stop(schedule, checkpointed == self.step, lost)
                    raise
                self._record(done)
                onset = self.spikes.observe(self.step, done.loss)
                if onset is not None:
                    schedule = self._roll_back(onset)
                    # it loaded the checkpoint of this step, unless it waits for a heal
                    checkpointed = -1 if self._heal_for_rollback is not None else self.step
                    continue
                last = self.step == config.training.steps
                saved = False
                if schedule.checkpoint_allowed:
                    saved = self.checkpointer.save(self.step, last_step=last)
                    checkpointed = self.step if saved else checkpointed
                elif last:
                    logger.warning(
                        f"the last step {self.step} is not checkpointed: anticipatory routing is "
                        f"still in {schedule.phase.name} (checkpoints are written in NORMAL only)"
                    )
                if done.stop and not last:
                    self.stopped = self._stop(schedule, saved)
                    break
                if config.validator.enable and self.validator.should_validate(self.step):
                    self.validator.validate(self.model_parts, self.step)
                profiler.step()
                if self.step - loaded_step == 1:
                    dist_utils.set_pg_timeouts(
                        timeout=timedelta(seconds=config.comm.train_timeout_seconds),
                        parallel_dims=self.parallel_dims,
                    )
        if self.stopped is None:
            logger.info("Training completed")

    def request_stop(self, why: str) -> None:
        """Stop after the step whose vote comes next, on every rank and replica, with a
        checkpoint of the last committed step. Only sets a flag, so a signal handler may call
        it at any moment; the first request names the stop."""
        if self._stop_asked_by is None:
            self._stop_asked_by = why

    def _stop(
        self, schedule: AnticipatorySchedule[Batch], saved: bool, why: str | None = None
    ) -> Stopped:
        """The stop after the committed step ``self.step`` (agreed, unless ``why`` names another
        cause): a full, resumable checkpoint of it unless the interval save just wrote one (or
        routing forbids one)."""
        why = why or self._stop_asked_by or "the request of another rank or replica"
        checkpoint = Path(self.checkpointer._create_checkpoint_id(self.step))
        if self._heal_for_rollback is not None:
            stopped = Stopped(
                why, self.step, None,
                "no checkpoint: this replica held no rollback target and has not healed yet "
                "(its weights are the spike's)",
            )  # fmt: skip
        elif not schedule.checkpoint_allowed:
            stopped = Stopped(
                why, self.step, None,
                f"no checkpoint: anticipatory routing is in {schedule.phase.name} (checkpoints "
                f"are written in NORMAL only; the newest earlier one stays valid)",
            )  # fmt: skip
        elif saved or self.checkpointer.save_now(self.step):
            stopped = Stopped(why, self.step, checkpoint)
        else:
            stopped = Stopped(why, self.step, None, "no checkpoint: checkpointing is off")
        self.step_log.write(
            event="stop", step=self.step, why=why, replica=self.replica_id,
            checkpoint=str(stopped.checkpoint) if stopped.checkpoint else None,
        )  # fmt: skip
        logger.info(str(stopped))
        return stopped

    def _record(self, done: CommittedStep) -> None:
        """The committed step in ``steps.jsonl``, torchtitan's metrics and the progress line."""
        loss, grad_norm = done.loss, done.grad_norm
        if not math.isfinite(loss):
            raise RuntimeError(f"loss is not finite ({loss}) at committed step {done.step}")
        ft = {"ft_seconds": done.timings} if done.timings else {}
        self.step_log.write(
            step=done.step, loss=loss, grad_norm=grad_norm, phase=done.phase.value,
            attempts=done.attempts, participants=done.participants,
            replica=self.replica_id, **done.lr, **ft,
        )  # fmt: skip
        if self._progress_start is None:
            self._progress_start = (self.step - 1, time.monotonic())
        if not self.metrics_processor.should_log(self.step):
            return
        extra = {
            "n_tokens_seen": self.ntokens_seen,
            "ft/participants": done.participants,
            "step/attempts": done.attempts,
            **done.lr,
        }
        self.metrics_processor.log(self.step, loss, loss, grad_norm, extra_metrics=extra)
        first, start = self._progress_start
        elapsed = time.monotonic() - start
        total = self.config.training.steps
        left = elapsed / max(self.step - first, 1) * (total - self.step)
        logger.info(
            f"progress: step {self.step}/{total} ({100 * self.step / total:.0f}%), "
            f"{elapsed:.0f}s elapsed, ~{left:.0f}s left"
        )

    def close(self) -> None:
        stepper = getattr(self, "stepper", None)
        if stepper is not None:
            stepper.close()
        super().close()

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The whole sequences, also under context parallelism: DeepSeek-V4 computes its own
        slice of them (``parallelism.context_parallel_degree``; see ``ttnpu.dsv4.titan``), so
        torchtitan's sharding of the inputs is skipped. The tokens of this rank's slice are
        counted as seen, as torchtitan counts its shard (tokens/s is per rank)."""
        inputs = input_dict["input"]
        shard = self.model_parts[0].model.shard(inputs.shape[1])
        self.ntokens_seen += inputs.shape[0] * (shard.stop - shard.start)
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, extra

    def _forward_backward_body(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        extra_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One microbatch: the model's mean loss over its valid tokens, rescaled so the
        microbatches of a step sum to the mean over the step's global valid tokens (the
        normalisation torchtitan's own losses use)."""
        with self.train_context():
            loss = self.model_parts[0](inputs, labels=labels)
            loss = loss * ((labels != IGNORE_INDEX).sum() / global_valid_tokens)
            loss.backward()
        return loss
