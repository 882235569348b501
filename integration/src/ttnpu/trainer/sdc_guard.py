"""ttnpu-sdc inside the training step: what is checked on each attempt and what a detection means.

By default (``checksums = "escalate"``) gradient statistics are judged at every step, and the
matmul checksums run only while those have struck (for a cooldown), on a sampled fraction of steps
and on every re-run: the escalation policy of torch_npu's own detection, cheap enough to leave on.
With ``checksum_verdicts = "step"`` a first attempt reads its screens once, when its backward
ends (a suspect is reported unconfirmed); re-runs always read and confirm each product.

Every detection is written to ``sdc_events.jsonl`` in the run folder and vetoes the step on every
replica, so nothing corrupted is committed anywhere: a matmul whose checksum is wrong, a gradient
whose statistics jump, a non-finite loss, a cross-replica gradient all-reduce or an FSDP2 gradient
reduce-scatter whose checksums do not match. The step is then re-run on the same batches with the
checksums on: a clean re-run commits (the fault was transient); a re-run corrupted again proves a
persistent fault, and this replica leaves the job
(:data:`~ttnpu.trainer.features.EXIT_PERSISTENT_SDC`).

The reduce-scatter inside a replica group adds a collective when checked, so it is checked on the
steps every rank agrees on without a word: with ``checksums = "always"``, on the sampled steps and
on every re-run (an escalation ends by each rank's clock, so it does not count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Literal

import torch

from ttnpu.sdc import (
    BitFlip,
    CheckedReduceScatter,
    ChecksumMode,
    ChecksumSwitch,
    EventLog,
    FaultPlan,
    GradientDetector,
    LogAction,
    MatmulFaultMode,
    ReductionChecksums,
    Reporter,
    SDCConfig,
    SDCEvent,
    VetoFlag,
    check_fsdp_reduce_scatter,
    flip_bit,
)

from .features import SilentDataCorruption

__all__ = ["SDCGuard"]


class SDCGuard:
    """The detectors of one replica, their events, and the injected fault when one is planned."""

    def __init__(
        self,
        config: SilentDataCorruption,
        model: torch.nn.Module,
        *,
        replica_id: int,
        events_path: Path,
        rank: int | None = None,
    ) -> None:
        """``rank`` stamps the events (default: ``replica_id``): the rank's position in the
        whole job, over all replica groups."""
        self.config = config
        self.replica_id = replica_id
        sample = config.checksum_sample_steps if config.checksums == "escalate" else 0.0
        self.switch = ChecksumSwitch(on=config.checksums == "always", sample_steps=sample)
        self.flag = VetoFlag()
        self.log = EventLog(events_path)
        self.reporter = Reporter(
            [LogAction(), self.log, self.flag], rank=replica_id if rank is None else rank
        )
        self.detector = (
            GradientDetector(
                model.named_parameters(),
                SDCConfig(warmup_steps=config.gradient_warmup_steps),
                reporter=self.reporter,
                switch=self.switch,
                group=None,
            )
            if config.gradient
            else None
        )
        self.injected = 0
        self._step, self._attempt = 0, 0
        self._reduction_hit = (0, 0)  # the attempt whose all-reduce was corrupted
        self._scatter_hit = (0, 0)  # the attempt whose reduce-scatter was corrupted
        self._scatter_checked = False
        self.reduce_scatter = CheckedReduceScatter(
            checking=lambda: self._scatter_checked,
            reporter=self.reporter,
            fault=self._corrupt_reduce_scatter,
        )
        sharded = check_fsdp_reduce_scatter(model, self.reduce_scatter)
        if config.inject_kind == "reduce_scatter" and config.inject_step and not sharded:
            raise ValueError(
                "sdc.inject_kind reduce_scatter needs FSDP2 sharding "
                "(parallelism.data_parallel_shard_degree > 1): this model reduce-scatters nothing"
            )

    def veto_through(self, raise_flag: Callable[[str], None]) -> None:
        """Every detection from now on also asks ``raise_flag`` (the stepper's cross-replica
        veto) to discard the step, as it is reported: no detection waits in a queue for the
        trainer to forward it."""

        def veto(event: SDCEvent) -> None:
            raise_flag(f"SDC on replica {self.replica_id}: {event.kind} at {event.where}")

        self.reporter.actions.append(veto)

    def reduction_check(self, max_world: int) -> ReductionChecksums:
        """The check of the cross-replica gradient all-reduce, bucket by bucket (ttnpu-ft's
        ``ReductionCheck``), reporting here and carrying the planned all-reduce fault (into the
        attempt's first checked bucket only)."""
        return ReductionChecksums(
            max_world, reporter=self.reporter, fault=self._corrupt_reduction, name="grad_allreduce"
        )

    def _due(self, kind: str) -> bool:
        c = self.config
        return (
            c.inject_kind == kind
            and self._step == c.inject_step
            and self.replica_id == c.inject_replica
            and (self._attempt == 1 or c.inject_persistent)
        )

    def _corrupt_reduction(self, name: str, result: torch.Tensor) -> None:
        if self._due("allreduce") and self._reduction_hit != (self._step, self._attempt):
            self._reduction_hit = (self._step, self._attempt)
            flip_bit(result, 0, self.config.inject_bit)
            self.injected += 1

    def _corrupt_reduce_scatter(self, name: str, result: torch.Tensor) -> None:
        if self._due("reduce_scatter") and self._scatter_hit != (self._step, self._attempt):
            self._scatter_hit = (self._step, self._attempt)
            flip_bit(result, 0, self.config.inject_bit)
            self.injected += 1

    def _checking(self, step: int, attempt: int) -> bool:
        """Every re-run; else while on, escalated or on a sampled step (``switch``)."""
        on = self.switch.begin_step(step)
        return attempt > 1 or (self.config.checksums != "off" and on)

    def _fault(self) -> FaultPlan | None:
        if not self._due("matmul"):
            return None
        return FaultPlan(flips=[BitFlip(index=0, bit=self.config.inject_bit)], phase="forward")

    @contextmanager
    def watch(self, step: int, attempt: int) -> Iterator[None]:
        """Around the forward+backward of an attempt: the planned fault (outermost, so the
        checks see it) and the matmul checksums when they are on."""
        self.reporter.step = step
        self._step, self._attempt = step, attempt
        checks = self.config.checksums
        self._scatter_checked = (
            attempt > 1
            or checks == "always"
            or (checks == "escalate" and self.switch.step_sampled(step))
        )
        with ExitStack() as stack:
            plan = self._fault()
            if plan is not None:
                stack.enter_context(MatmulFaultMode(plan))
            if self._checking(step, attempt):
                per_step = attempt == 1 and self.config.checksum_verdicts == "step"
                verdicts: Literal["each", "on_exit"] = "on_exit" if per_step else "each"
                stack.enter_context(
                    ChecksumMode(reporter=self.reporter, switch=_ALWAYS, verdicts=verdicts)
                )
            yield
            if plan is not None:
                self.injected += plan.fired

    def after_backward(self, attempt: int, loss: torch.Tensor) -> None:
        """Judge the attempt's gradients (first attempts only: a re-run is judged by its
        checksums) and loss."""
        if not torch.isfinite(loss).all():
            self.reporter.report(
                "gradient", "loss", magnitude=float("inf"), confirmed=False,
                detail={"loss": float(loss)},
            )  # fmt: skip
        elif attempt == 1 and self.detector is not None:
            self.detector.check()

    def take_events(self) -> list[SDCEvent]:
        """The events reported since the last call: the record of one attempt (its matmul
        checks, gradient statistics and the all-reduce check, which reports after the
        backward)."""
        return self.flag.take()

    @staticmethod
    def corrupted(events: list[SDCEvent]) -> bool:
        """Whether ``events`` prove a corruption (a confirmed matmul or collective checksum
        mismatch), as opposed to a statistical anomaly."""
        return any(e.kind in ("matmul", "collective") and e.confirmed for e in events)


_ALWAYS = ChecksumSwitch(on=True)
"""Checks every matmul while ``ChecksumMode`` is entered (entering is the guard's decision)."""
