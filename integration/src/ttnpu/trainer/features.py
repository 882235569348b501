"""The trainer's feature switches: the ``fault_tolerance``, ``sdc`` and ``spike`` config sections.

Each is a section of :class:`~ttnpu.trainer.DSV4Trainer.Config`, set like any torchtitan option
(``--fault_tolerance.enable``, ``--sdc.checksums always``, ``--spike.enable``). The ``inject_*``
fields plant a real fault (a bit flip in a matmul output, a corruption of the weights) at a given
step, for the e2e tests and the fault drills; they are off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

__all__ = [
    "EXIT_LIGHTHOUSE_LOST",
    "EXIT_PERSISTENT_SDC",
    "EXIT_SPLIT_BRAIN",
    "FaultTolerance",
    "PersistentSDCError",
    "SilentDataCorruption",
    "SpikeRecovery",
]

EXIT_PERSISTENT_SDC = 3
"""Exit status of a replica taken out for a persistent silent data corruption: a step re-run on it
was corrupted again (the hardware, not a transient upset). The other replicas go on without it."""


EXIT_SPLIT_BRAIN = 4
"""Exit status of a replica group whose weights differ from the majority's at the same step
(split brain: groups that trained apart, see ``ttnpu.ft.SplitBrainError``). Restarted, it is
behind the others and heals from them."""


EXIT_LIGHTHOUSE_LOST = 5
"""Exit status of a replica that found no Lighthouse for ``quorum_timeout_seconds`` (torchft
retried meanwhile): it wrote a checkpoint of its last committed step first (``--resume``)."""


class PersistentSDCError(RuntimeError):
    """A re-run of a vetoed step was corrupted again on this replica."""


@dataclass(kw_only=True, slots=True)
class FaultTolerance:
    """One torchft replica group per process group (ttnpu-ft): quorum, heal, commit veto.
    ``replica_id``, ``group_size`` and ``min_replica_size`` are torchtitan's own torchft names;
    the earlier ``replicas`` and ``min_replicas`` (older run folders) are their aliases."""

    enable: bool = False
    """Train as a torchft replica group (needs a Lighthouse; ``ttnpu-train --replicas N`` starts
    one)."""

    replica_id: int = 0
    """This replica group's id, in [0, group_size)."""

    group_size: Annotated[int, tyro.conf.arg(aliases=("--fault-tolerance.replicas",))] = 1
    """Number of replica groups; the data is split into this many shards, one per group."""

    lighthouse: str = ""
    """Lighthouse address (``http://host:port``); empty: the ``TORCHFT_LIGHTHOUSE`` variable."""

    host: str = ""
    """The address the other replica groups reach this one at (its torchft Manager, store and
    heal transfers); empty: this host's name. For a host on several networks."""

    min_replica_size: Annotated[int, tyro.conf.arg(aliases=("--fault-tolerance.min-replicas",))] = 1
    """Fewest replica groups a step may commit with."""

    collective_timeout_seconds: float = 10.0
    """A cross-replica collective that takes longer is stopped and the step discarded; with
    ``collective_timeout_steps``, the floor of the timeout."""

    collective_timeout_steps: float = 5.0
    """The collective timeout follows this many median committed step times (never below
    ``collective_timeout_seconds``), so that slow steps on a loaded host are not discarded; 0:
    fixed at ``collective_timeout_seconds``; else at least 3."""

    quorum_timeout_seconds: float = 120.0
    """How long a quorum (and a heal) may take, and how long a lost Lighthouse may stay away
    (a restarted one is rejoined) before the replica checkpoints and exits
    (``EXIT_LIGHTHOUSE_LOST``)."""

    step_timeout_seconds: float = 0.0
    """Watchdog over one forward+backward; 0 turns it off."""

    max_attempts: int = 8
    """A step that is discarded this many times in a row stops the run with an error."""

    fingerprint_every_steps: int = 0
    """Compare the replicas' weights (an exact fingerprint, two reads of the weights) every this
    many steps too; they are always compared when the quorum's membership changes, which is when
    groups that trained apart meet again. 0: only then."""

    start_barrier: str = ""
    """A folder where replica groups started together wait for each other before their first
    quorum (``--replicas N`` sets it); empty: no waiting (a replica that joins a running job)."""

    checkpoint_folder: str = ""
    """Checkpoints shared by the replica groups (torchtitan's fault-tolerant layout): a folder
    every group reaches, relative to the run folder like ``--checkpoint.folder`` (``../checkpoint``
    under ``--replicas N``, whose groups' run folders sit side by side). One group writes each
    full checkpoint (the quorum's participating rank 0), every group its data position into
    ``ft-replica-<id>/`` there: one copy of the model and optimizer instead of one per group.
    Empty: each group writes full checkpoints into its own run folder."""

    def shared_checkpoints(self, run: Path) -> Path | None:
        """The folder of :attr:`checkpoint_folder` for the run folder ``run``, or None."""
        return (run / self.checkpoint_folder).resolve() if self.checkpoint_folder else None

    @property
    def replicas(self) -> int:
        """:attr:`group_size` by its earlier name."""
        return self.group_size

    @property
    def min_replicas(self) -> int:
        """:attr:`min_replica_size` by its earlier name."""
        return self.min_replica_size

    def validate(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"fault_tolerance.group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.replica_id < self.group_size:
            raise ValueError(
                f"fault_tolerance.replica_id {self.replica_id} must be in [0, group_size = "
                f"{self.group_size})"
            )
        if not 1 <= self.min_replica_size <= self.group_size:
            raise ValueError(
                f"fault_tolerance.min_replica_size {self.min_replica_size} must be in "
                f"[1, group_size = {self.group_size}]"
            )
        for name in ("collective_timeout_seconds", "quorum_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"fault_tolerance.{name} must be > 0, got {getattr(self, name)}")
        if self.collective_timeout_steps != 0 and self.collective_timeout_steps < 3:
            raise ValueError(
                f"fault_tolerance.collective_timeout_steps must be 0 (fixed) or >= 3 (step "
                f"times), got {self.collective_timeout_steps}"
            )
        if self.step_timeout_seconds < 0:
            raise ValueError(
                f"fault_tolerance.step_timeout_seconds must be >= 0, got "
                f"{self.step_timeout_seconds}"
            )
        if self.fingerprint_every_steps < 0:
            raise ValueError(
                f"fault_tolerance.fingerprint_every_steps must be >= 0, got "
                f"{self.fingerprint_every_steps}"
            )
        if self.max_attempts < 2:
            raise ValueError(f"fault_tolerance.max_attempts must be >= 2, got {self.max_attempts}")


@dataclass(kw_only=True, slots=True)
class SilentDataCorruption:
    """Detection (ttnpu-sdc) and its action: a detection vetoes the step on every replica and the
    step is re-run with checksums on; corrupted again means a persistent fault, and the replica
    exits with :data:`EXIT_PERSISTENT_SDC`. With fault tolerance on, the cross-replica gradient
    all-reduce is verified too (chunk checksums reduced alongside it); with FSDP2, the gradient
    reduce-scatter inside the replica group on the steps whose matmuls every rank checks
    (always, sampled, re-runs)."""

    enable: bool = True
    """Watch this replica's computation."""

    checksums: Literal["always", "escalate", "off"] = "escalate"
    """Matmul checksums in forward and backward: on every step; while gradient statistics have
    escalated, on sampled steps (``checksum_sample_steps``) and on every re-run; or only on
    re-runs."""

    checksum_sample_steps: float = 0.01
    """With ``checksums = "escalate"``: the fraction of steps checked anyway (the same steps on
    every replica), so a corruption that leaves gradient statistics alone is still found; a
    persistent fault is caught within ~1/fraction steps."""

    checksum_verdicts: Literal["each", "step"] = "each"
    """When a checked first attempt reads its matmul screens: for ``each`` product at once (a host
    sync per product; a suspect is recomputed and confirmed on the spot), or once per ``step``
    (one host sync per attempt, which keeps an accelerator's queue full; a suspect is reported
    unconfirmed and vetoes the step, whose re-run reads each product and confirms)."""

    gradient: bool = True
    """Gradient feature-value detection at every optimizer step (before the cross-replica
    all-reduce, so the replica that produced a bad gradient is the one that notices)."""

    gradient_warmup_steps: int = 10
    """Normal steps a gradient's statistics need before it can be judged."""

    inject_step: int = 0
    """Flip a bit at this step (0: never), where ``inject_kind`` says."""

    inject_kind: Literal["matmul", "allreduce", "reduce_scatter"] = "matmul"
    """Where the injected bit flip lands: one forward matmul output, the gradients from the
    cross-replica all-reduce, or those from the first FSDP2 reduce-scatter (every rank of the
    replica group)."""

    inject_replica: int = 0
    """The replica id that gets the fault."""

    inject_persistent: bool = False
    """Corrupt every attempt of the step (a broken unit) rather than the first only."""

    inject_bit: int = 30
    """The bit flipped (30: the top exponent bit of an fp32 value)."""

    def validate(self) -> None:
        if not 0.0 <= self.checksum_sample_steps <= 1.0:
            raise ValueError(
                f"sdc.checksum_sample_steps must be in [0, 1], got {self.checksum_sample_steps}"
            )
        if self.gradient_warmup_steps < 1:
            raise ValueError(
                f"sdc.gradient_warmup_steps must be >= 1, got {self.gradient_warmup_steps}"
            )
        if self.inject_step < 0 or self.inject_replica < 0:
            raise ValueError("sdc.inject_step and sdc.inject_replica must be >= 0")
        if self.inject_step and not self.enable:
            raise ValueError("sdc.inject_step needs sdc.enable (nothing would detect the fault)")


@dataclass(kw_only=True, slots=True)
class SpikeRecovery:
    """Loss-spike detection, rollback to the newest checkpoint before the spike's onset, and
    anticipatory routing afterwards (ttnpu-routing). Every replica judges the same
    replica-averaged loss, so all roll back together."""

    enable: bool = False
    """Watch the loss and roll back on a spike."""

    warmup_steps: int = 100
    """Steps of loss history before a spike can be called."""

    z_threshold: float = 6.0
    """A step whose loss is this many standard deviations above the forecast is a spike."""

    cooldown_steps: int = 500
    """Committed steps after a rollback during which no new spike is called."""

    anticipatory: bool = True
    """After a rollback, route with expert choices computed ``delay_steps`` updates ahead."""

    delay_steps: int = 16
    """How far ahead routes are computed (Δt)."""

    active_steps: int = 500
    """Steps trained on anticipated routes before draining back to live routing."""

    inject_step: int = 0
    """Corrupt the weights (seeded noise, the same on every replica) just before this step, once
    (0: never): the loss spikes, and the rollback removes the corruption."""

    inject_scale: float = 10.0
    """Noise standard deviation, relative to each weight tensor's own."""

    def validate(self) -> None:
        if self.warmup_steps < 2:
            raise ValueError(f"spike.warmup_steps must be >= 2, got {self.warmup_steps}")
        if self.z_threshold <= 0 or self.cooldown_steps < 0:
            raise ValueError("spike.z_threshold must be > 0 and spike.cooldown_steps >= 0")
        if self.delay_steps < 0 or self.active_steps < 1:
            raise ValueError("spike.delay_steps must be >= 0 and spike.active_steps >= 1")
        if self.inject_step < 0 or self.inject_scale <= 0:
            raise ValueError("spike.inject_step must be >= 0 and spike.inject_scale > 0")
