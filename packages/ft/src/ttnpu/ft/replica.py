"""One replica group's view of fault-tolerant training: the package's main entry point.

``Replica`` wires torchft's Manager (quorum, heal, commit) to the pieces torchft lacks: a device
adapter with in-process recovery, a validated state carry-over, a cross-replica commit veto and
replica-consistent MoE counters. A training loop calls ``run_step(fn)`` once per step.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import TCPStore
from torchft import Manager
from torchft.checkpointing.transport import CheckpointTransport

from ttnpu.ft.devices import DeviceAdapter, select_adapter
from ttnpu.ft.fingerprint import SplitBrainCheck
from ttnpu.ft.lighthouse import LighthouseUnreachable, check_lighthouse
from ttnpu.ft.managed import ManagedAllreduce
from ttnpu.ft.moe_balance import expert_counters, pack_counts, unpack_counts
from ttnpu.ft.recovery import StaleProcessGroup, StepRecovery
from ttnpu.ft.reducer import GradientReducer, ReductionCheck
from ttnpu.ft.snapshot import ReplicaState, Stateful
from ttnpu.ft.transport import SocketTransport
from ttnpu.ft.veto import CommitVeto, CommitVetoed, Vote

__all__ = ["LRScheduler", "ReductionCheck", "Replica", "ReplicaConfig", "StepResult"]

logger = logging.getLogger(__name__)

# While the Lighthouse is unreachable (it died, a supervisor restarts it), torchft's Manager
# retries the quorum about this often, for up to ReplicaConfig.quorum_timeout.
LIGHTHOUSE_RETRY_SECONDS = 1.0

# A collective waits for the slowest replica's forward and backward, so a timeout below a few
# step times discards healthy steps whenever a host is loaded or a batch runs long.
TIMEOUT_STEP_MULTIPLE = 3.0


class LRScheduler(Stateful, Protocol):
    """What the replica needs of an LR scheduler: stepped only on committed steps."""

    def step(self) -> None: ...


@dataclass(frozen=True)
class ReplicaConfig:
    """Settings of one replica group (validated on construction)."""

    replica_id: int
    lighthouse: str | None = None  # None: TORCHFT_LIGHTHOUSE
    min_replica_size: int = 1
    device: str | None = None  # "cpu" | "cuda" | "npu"; None: the available accelerator, else cpu
    collective_timeout: timedelta = timedelta(seconds=10)
    # > 0: the collective timeout follows this many median committed step times (of the last
    # 20, from the third on), never below collective_timeout; 0: it stays collective_timeout.
    collective_timeout_steps: float = 0.0
    step_timeout: timedelta | None = None  # watchdog over forward+backward; None: off
    timeout: timedelta = timedelta(seconds=60)  # commit RPC, heal transfer
    # A quorum's wait for its peers, and how long a lost Lighthouse may stay away: one that
    # comes back at the same address within it is rejoined; else run_step raises
    # LighthouseUnreachable.
    quorum_timeout: timedelta = timedelta(seconds=60)
    recovery_timeout: timedelta = timedelta(seconds=60)
    max_consecutive_recoveries: int = 3
    group_rank: int = 0
    group_world_size: int = 1
    store_addr: str | None = None  # the group's TCPStore; None with one rank: started here
    store_port: int | None = None
    # The address the other replicas reach this group at (its Manager, its store, its heal
    # transfers); None: this host's name. Set it on a host with several networks.
    host: str | None = None
    bucket_cap_mb: float = 4.0  # gradients at least this large are reduced alone, in place
    # Weights are compared across replicas when the quorum's membership changes (split brain,
    # see ttnpu.ft.fingerprint) and, when > 0, also every this many steps (two reads of them).
    fingerprint_every: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("replica_id", self.replica_id >= 0, ">= 0"),
            ("min_replica_size", self.min_replica_size >= 1, ">= 1"),
            ("group_world_size", self.group_world_size >= 1, ">= 1"),
            (
                "group_rank",
                0 <= self.group_rank < self.group_world_size,
                "in [0, group_world_size)",
            ),
            ("max_consecutive_recoveries", self.max_consecutive_recoveries >= 0, ">= 0"),
            ("bucket_cap_mb", self.bucket_cap_mb > 0, "> 0"),
            ("fingerprint_every", self.fingerprint_every >= 0, ">= 0"),
            (
                "collective_timeout_steps",
                self.collective_timeout_steps == 0
                or self.collective_timeout_steps >= TIMEOUT_STEP_MULTIPLE,
                f"0 (off) or >= {TIMEOUT_STEP_MULTIPLE:g}",
            ),
        ]
        for name in ("collective_timeout", "timeout", "quorum_timeout", "recovery_timeout"):
            checks.append((name, getattr(self, name).total_seconds() > 0, "> 0 s"))
        if self.step_timeout is not None:
            checks.append(("step_timeout", self.step_timeout.total_seconds() > 0, "> 0 s or None"))
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"ReplicaConfig.{name} must be {rule}, got {getattr(self, name)}")
        if self.group_world_size > 1 and (self.store_addr is None or self.store_port is None):
            raise ValueError("ReplicaConfig: a group of several ranks needs store_addr/store_port")


class HealingStep(RuntimeError):
    """Reported on every replica of a step whose quorum held a replica behind the others."""


class _QuorumRecorder:
    """torchft's ManagerClient, keeping the last quorum's result: its whole membership
    (``replica_world_size``) beside the replicas at the highest step (``max_world_size``), which
    is all torchft's asynchronous quorum reports as its participants.

    In a replica group of one rank it answers ``should_commit`` itself: the ManagerServer's
    answer is the AND of the group's ranks' own decisions, here that one rank's, and the RPC
    to it costs 0.4-0.9 ms a step on a 2-core host (most of the fault tolerance's own time)."""

    def __init__(self, client: Any, group_world_size: int) -> None:
        self._client = client
        self._group_world_size = group_world_size
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def should_commit(self, group_rank: int, step: int, should_commit: bool, **kwargs: Any) -> bool:
        if self._group_world_size == 1:
            return should_commit
        return bool(self._client.should_commit(group_rank, step, should_commit, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@dataclass
class StepResult:
    committed: bool
    step: int  # the Manager's step after the vote (committed steps so far)
    vetoed: bool = False
    recovered: bool = False
    participants: int = 0  # replicas whose gradients the step averaged (a healing one's: none)
    stop: bool = False  # the replicas agreed to stop after this step (CommitVeto.request_stop)
    healing: bool = False  # discarded by every replica: one of them healed in the step's quorum
    seconds: float = 0.0
    output: Any = None
    timings: dict[str, float] = field(default_factory=dict)


class Replica:
    """A model + optimizer trained as one torchft replica group.

    ``run_step(fn)``: quorum started -> ``fn()`` (forward/backward; gradients are averaged
    across replicas in buckets during the backward; before the first bucket the quorum is
    awaited and checked: process group, weights fingerprint when the membership changed with
    ``SplitBrainError`` on a minority, see :mod:`ttnpu.ft.fingerprint`; when the backward ends,
    the veto vote rides in the gradient flags' all-reduce: the flags raised so far, a requested
    stop (``StepResult.stop``) and the MoE token counters, summed) -> a second vote, one small
    all-reduce, only where a flag can come after the exchange (a ``reduction_check``,
    ``late_flags``) or the output is averaged -> ``should_commit`` -> optimizer and LR scheduler
    step under the recovery lock. The quorum is asynchronous (computed while the forward runs)
    after a committed step, synchronous otherwise (a heal due to this replica lands before its
    forward);
    a quorum holding a replica behind the others discards the step everywhere
    (``StepResult.healing``). A discarded step cleans the training site and the LR scheduler does
    not move; whether its data is retried or skipped is the caller's choice.
    """

    def __init__(
        self,
        config: ReplicaConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: LRScheduler | None = None,
        extras: Mapping[str, Stateful] | None = None,
        adapter: DeviceAdapter | None = None,
        checkpoint_transport: CheckpointTransport[dict[str, Any]] | None = None,
        reduction_check: ReductionCheck | None = None,
    ) -> None:
        self.config = config
        self.reduction_check = reduction_check
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.adapter = adapter if adapter is not None else select_adapter(config.device)
        self.state = ReplicaState(model, optimizer, lr_scheduler, extras)
        self.pg = self.adapter.process_group(config.collective_timeout, config.recovery_timeout)
        self.recovery = StepRecovery(
            self.adapter,
            self.pg,
            model,
            (optimizer,),
            collective_timeout=config.collective_timeout,
            max_consecutive_recoveries=config.max_consecutive_recoveries,
        )
        self._store: TCPStore | None = None
        host = config.host or socket.gethostname()
        store_addr, store_port = config.store_addr, config.store_port
        if store_addr is None or store_port is None:
            # It listens on every interface; the others are given `host` (this host's name, as
            # torchft's Manager gives), since "localhost" names their own host, not this one.
            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = host, self._store.port
        self.store_address = f"{store_addr}:{store_port}"
        """Where the other replicas reach this group's store (a cross-replica process group's
        rendezvous, when this replica leads the quorum)."""
        self.heals = 0
        self.last_heal_seconds = 0.0
        self.last_heal_bytes = 0
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load_snapshot,
            state_dict=self.state.snapshot,
            min_replica_size=config.min_replica_size,
            use_async_quorum=False,  # chosen per step (see run_step)
            timeout=config.timeout,
            quorum_timeout=config.quorum_timeout,
            quorum_retries=max(
                1, round(config.quorum_timeout.total_seconds() / LIGHTHOUSE_RETRY_SECONDS)
            ),  # torchft waits quorum_timeout / (retries + 1) between two tries
            connect_timeout=config.quorum_timeout,
            rank=config.group_rank,
            world_size=config.group_world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=config.lighthouse,
            replica_id=f"ttnpu_ft_{config.replica_id}",
            hostname=host,
            checkpoint_transport=checkpoint_transport or SocketTransport(config.timeout, host),
        )
        collectives = ManagedAllreduce(self.manager, self.pg)
        self.veto = CommitVeto(collectives, self.adapter.device)
        self._counters = expert_counters(model)  # MoE token counters, summed in the vote
        self.reducer = GradientReducer(
            [p for p in model.parameters() if p.requires_grad],
            collectives,
            self.pg.size,
            cap_bytes=max(1, int(config.bucket_cap_mb * 2**20)),
            check=reduction_check,
            on_corrupt=self.veto.raise_flag,
            wait_guard=lambda wait: self.recovery.wait_collectives("allreduce_gradients", wait),
            wait_quorum=self._quorum_ready,
            ballot=self._cast_ballot,
            ballot_keeps=3,  # a healing replica's flags count, its counters do not
        )
        if not hasattr(self.manager, "_use_async_quorum"):  # set per step: must not go silent
            raise RuntimeError(
                "torchft's Manager has no _use_async_quorum, through which ttnpu-ft chooses the "
                "quorum mode per step (written for torchft 0.2): use the torchft of uv.lock"
            )
        self._quorums = _QuorumRecorder(self.manager._client, config.group_world_size)
        self.manager._client = self._quorums
        self._sync_quorum = True  # the next quorum: synchronous (see run_step)
        self._step_heals = 0  # heals before this step's quorum
        self._quorum_checked = False  # this step's quorum awaited and checked
        self._heal_in_quorum = False  # this step's quorum held a replica behind the others
        self._timings: dict[str, float] = {}
        self._late_vote = False  # this step wants a second vote after fn (see run_step)
        self._late_warned = False
        group_store = None
        if config.group_world_size > 1:
            group_store = TCPStore(
                store_addr,
                store_port,
                is_master=False,
                wait_for_workers=False,
                timeout=config.quorum_timeout,
            )
        self.split_brain = SplitBrainCheck(
            self.manager,
            list(model.parameters()),
            config.replica_id,
            self.adapter.device,
            every_steps=config.fingerprint_every,
            group_rank=config.group_rank,
            group_world_size=config.group_world_size,
            store=group_store,
        )
        self._step_seconds: deque[float] = deque(maxlen=20)
        self._timeout_warned = False
        self.collective_timeout = config.collective_timeout
        """The timeout the collectives run under now (it moves with collective_timeout_steps)."""
        self._closed = False

    def _quorum_ready(self) -> None:
        """Wait for this step's quorum (once a step, before its first collective) and check it:
        a process group built for other members is discarded (``StaleProcessGroup``), the
        weights are compared when the membership changed (``SplitBrainError``), and a quorum
        holding a replica behind the others marks the step to be discarded by every replica."""
        if self._quorum_checked:
            return
        self._quorum_checked = True
        t0 = time.perf_counter()
        self._await_quorum()
        self._timings["quorum"] += time.perf_counter() - t0
        if self.manager.errored() is not None:  # the quorum failed: the vote discards the step
            return
        quorum = self._quorums.last
        self._check_process_group(quorum.replica_world_size)
        self._heal_in_quorum = quorum.max_world_size < quorum.replica_world_size
        t1 = time.perf_counter()
        healed = self.heals != self._step_heals or not self.manager.is_participating()
        self.split_brain.run(healed, self.recovery.guard, defer=self._heal_in_quorum)
        self._timings["fingerprint"] = time.perf_counter() - t1  # ~0 unless compared

    def _check_process_group(self, members: int) -> None:
        """torchft rebuilds its process group when the quorum's number changes, and a restarted
        Lighthouse numbers its quorums from 1 again: a quorum of other members can come under
        the number the group was built for, whose collectives would then wait for a replica
        not in the step (or leave one out of the average). Such a step is discarded before it
        starts (``StaleProcessGroup``); a later quorum of a new number rebuilds the group."""
        built = self.pg.size()
        if built != members:
            raise StaleProcessGroup(
                f"the quorum has {members} replica(s), the process group was built for {built} "
                f"(a restarted Lighthouse reused a quorum number)"
            )

    def _raise_if_lighthouse_lost(self, error: Exception) -> None:
        """A quorum that failed because the Lighthouse stayed away (torchft retried it for
        ``quorum_timeout``) as ``LighthouseUnreachable``; any other failure is left as it is."""
        try:
            check_lighthouse(self.config.lighthouse, timeout=2.0)
        except LighthouseUnreachable as lost:
            waited = self.config.quorum_timeout.total_seconds()
            raise LighthouseUnreachable(
                f"no Lighthouse answered for {waited:g} s (quorum_timeout): {lost}"
            ) from error

    def _load_snapshot(self, snapshot: Any) -> None:
        start = time.perf_counter()
        self.state.restore(snapshot)
        self.heals += 1
        self.last_heal_seconds = time.perf_counter() - start
        leaves = torch.utils._pytree.tree_leaves(snapshot)
        self.last_heal_bytes = sum(
            t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
        )

    # -- the step ----------------------------------------------------------------------------------
    def allreduce_gradients(self) -> None:
        """Average every gradient across the participating replicas (see :mod:`ttnpu.ft.reducer`).

        ``run_step`` does it during the backward; this finishes what the backward did not (no
        backward in the step, or gradients FSDP2 assigned without the gradient-ready hook). A
        parameter no replica produced a gradient for gets ``grad = None``; with a
        ``reduction_check`` a bucket that fails it vetoes the step."""
        self.reducer.finish()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside only accumulate: all but the last micro-batch of a step (as DDP's)."""
        return self.reducer.no_sync()

    def set_step(self, step: int) -> None:
        """Align torchft's step counter with a training step loaded from a checkpoint (a resume or
        a rollback), on every replica alike: the quorum heals replicas behind the highest step."""
        if step < 0:
            raise ValueError(f"Replica.set_step: step must be >= 0, got {step}")
        self.manager.load_state_dict({"step": step, "batches_committed": step})
        self._sync_quorum = True  # a heal may be due: the next quorum lands it before the forward

    def _cast_ballot(self) -> torch.Tensor:
        """The step's first ballot, cast when the backward ends: the flags, then whether this
        replica wants a second vote, then the MoE counters (their sums replace them)."""
        parts = [torch.ones(1) if self._late_vote else torch.zeros(1)]
        if self._counters:
            parts.append(pack_counts(self._counters))
        return self.veto.ballot(torch.cat([p.to(self.adapter.device) for p in parts]))

    def _first_vote(self) -> tuple[Vote, bool]:
        """The decision of the ballot cast in the gradient flags' all-reduce, and whether any
        replica asked for a second vote; the counters become their sums over the replicas."""
        sums = self.reducer.ballot_sums
        assert sums is not None, "the reducer casts a ballot every step"
        vote = self.veto.count(sums)
        assert vote.payload is not None
        if self._counters:
            unpack_counts(self._counters, vote.payload[1:])
        return vote, bool(vote.payload[0] > 0)

    def _second_vote(self, output: Any, average: bool) -> tuple[Vote, Any]:
        """The flags raised after the exchange, and the output summed: with ``average`` the
        output comes back as its mean over the participants, float32 on its own device."""
        payload = None
        if average:
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"run_step(average_output=True) needs fn to return a tensor, got "
                    f"{type(output).__name__}"
                )
            payload = output.detach().reshape(-1).to(torch.float32).to(self.adapter.device)
        vote = self.veto.vote(payload)
        if average:
            assert vote.payload is not None
            mean = vote.payload / self.reducer.contributors
            output = mean.view(output.shape).to(dtype=torch.float32, device=output.device)
        return vote, output

    def _late_flags_alone(self) -> bool:
        """Flags raised after the exchange in a step with no second vote discard this replica's
        step alone (it heals from a peer at the next quorum): the others already committed to it."""
        late = self.veto.pending
        if not late:
            return False
        self.veto.discard()
        if self.manager.errored() is None:
            self.manager.report_error(
                CommitVetoed(f"step vetoed here only (raised after the exchange): {late}")
            )
        if not self._late_warned:
            self._late_warned = True
            logger.warning(
                "a veto flag was raised after the gradients were exchanged, in a step with no "
                "second vote: only this replica discards it and heals; pass "
                "run_step(late_flags=True) where flags come after the backward"
            )
        return True

    def _settle_quorum(self) -> None:
        """A step that failed before its first collective: its quorum is still awaited (a lost
        Lighthouse named as such) and the weights check told it was skipped here."""
        if self._quorum_checked:
            return
        self._quorum_checked = True
        self._await_quorum()
        self.split_brain.skip()

    def _await_quorum(self) -> None:
        """torchft's wait for the step's quorum; a lost Lighthouse is named as such."""
        try:
            self.manager.wait_quorum()
        except Exception as error:
            self._raise_if_lighthouse_lost(error)
            raise

    def run_step(
        self,
        fn: Callable[[], Any],
        *,
        average_output: bool = False,
        late_flags: bool = False,
        before_update: Callable[[], None] | None = None,
    ) -> StepResult:
        """One fault-tolerant step; ``fn`` runs forward and backward (its result is returned).

        With ``average_output`` the result (a tensor, e.g. the loss) comes back averaged over the
        participating replicas, so every replica logs and judges the same value. ``late_flags``:
        ``fn`` may raise veto flags after its backward (a check of the averaged gradients), so
        a second vote is held after it; a flag raised after the exchange without one discards
        this replica's step only. ``before_update`` runs after the vote on a committed step, just
        before the optimizer (gradient clipping on the replica-averaged gradients)."""
        if self._closed:
            raise RuntimeError("Replica.run_step after close()")
        t0 = time.perf_counter()
        timings = self._timings = {"quorum": 0.0}
        self.recovery.begin_step()
        self._step_heals = self.heals
        self._quorum_checked = self._heal_in_quorum = False
        self._quorums.last = None
        self._late_vote = average_output or late_flags or self.reduction_check is not None
        # Asynchronous once this replica committed its last step: no heal is due to it, and the
        # quorum is computed while the forward runs (the first bucket waits for it). On its
        # first step, after set_step and after a step it did not commit, a heal may be due: the
        # quorum is synchronous and the heal lands before the forward. torchft reads the mode
        # per quorum.
        asynchronous = not self._sync_quorum
        self.manager._use_async_quorum = asynchronous
        self.state.hold_parts(asynchronous)  # a heal served during the step sends its start
        try:
            self.manager.start_quorum()
        except Exception as error:
            self._raise_if_lighthouse_lost(error)
            raise
        timings["quorum"] = time.perf_counter() - t0  # (+ the wait the forward did not hide)
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer.begin_step()
        output = None
        step_timeout = self.config.step_timeout
        try:
            try:
                if not asynchronous:
                    self._quorum_ready()
                if step_timeout is None:  # no step timer: only the collectives are watched
                    output = fn()
                else:
                    output = self.recovery.guard("forward_backward", fn, step_timeout)
                self.allreduce_gradients()  # its waits run under the collective watchdog
            finally:
                self.reducer.end_step()
            t2 = time.perf_counter()
            timings["allreduce"] = self.reducer.finish_s  # the waits left after the backward
            vote, second = self._first_vote()
            if second:  # every replica holds it alike: the first vote agreed on it
                # A peer that dies between the gradient all-reduce and this vote is caught here.
                late, output = self.recovery.guard(
                    "veto", lambda: self._second_vote(output, average_output)
                )
                vote = Vote(vote.vetoed or late.vetoed, vote.stop or late.stop)
            elif self._late_flags_alone():
                vote = Vote(True, vote.stop)
            timings["vote"] = time.perf_counter() - t2
        except Exception as error:
            if not self.recovery.is_recoverable(error):
                raise
            self._settle_quorum()
            self.veto.discard()
            self.recovery.recover(error)
            self.manager.report_error(error)
            committed = self.manager.should_commit()
            assert not committed, "a recovered step must not commit"
            self._sync_quorum = True
            return StepResult(
                committed=False,
                step=self.manager.current_step(),
                recovered=True,
                seconds=time.perf_counter() - t0,
                timings=timings,
            )
        if self._heal_in_quorum:
            # The replicas at the highest step trained it (under the asynchronous quorum)
            # while another was still healing: every replica discards it alike (they all hold
            # the same quorum) and the next step is joint.
            self.manager.report_error(
                HealingStep("a replica healed in this step's quorum: every replica discards it")
            )
        participants = self.reducer.contributors
        t3 = time.perf_counter()
        committed = self.manager.should_commit()
        timings["commit"] = time.perf_counter() - t3
        self._sync_quorum = not committed
        if committed:
            self.recovery.apply_update(lambda: self._update(before_update))
            self._step_seconds.append(time.perf_counter() - t0)
            if self.config.collective_timeout_steps:
                self._adapt_collective_timeout()
            else:
                self._check_collective_timeout()
        else:
            self.recovery.discard()
        return StepResult(
            committed=committed,
            step=self.manager.current_step(),
            vetoed=vote.vetoed,
            participants=participants,
            stop=vote.stop,
            healing=self._heal_in_quorum,
            seconds=time.perf_counter() - t0,
            output=output,
            timings=timings,
        )

    def _adapt_collective_timeout(self) -> None:
        """Follow ``collective_timeout_steps`` median step times (not below the configured
        timeout), moved when it changes by more than a quarter: in the watchdog, in torchft's
        process group (its waits, and the backend of its next configuration) and in the live
        backend (torch's ``ProcessGroup.set_timeout``), which on gloo is what cuts a collective
        short."""
        if len(self._step_seconds) < 3:
            return
        median = statistics.median(self._step_seconds)
        target = max(
            self.config.collective_timeout.total_seconds(),
            self.config.collective_timeout_steps * median,
        )
        current = self.collective_timeout.total_seconds()
        if abs(target - current) <= current / 4:
            return
        timeout = timedelta(seconds=target)
        self.recovery.watchdog.timeout_s = target
        self.pg.set_timeout(timeout)
        self.pg.parent.set_timeout(timeout)
        self.collective_timeout = timeout
        logger.info(
            "collective timeout %.1f s -> %.1f s (%gx the median step time %.2f s)",
            current,
            target,
            self.config.collective_timeout_steps,
            median,
        )

    def _check_collective_timeout(self) -> None:
        """Warn once when ``collective_timeout`` is under TIMEOUT_STEP_MULTIPLE times the median
        committed step time (of the last 20, from the third on)."""
        if self._timeout_warned or len(self._step_seconds) < 3:
            return
        median = statistics.median(self._step_seconds)
        timeout = self.config.collective_timeout.total_seconds()
        if timeout < TIMEOUT_STEP_MULTIPLE * median:
            self._timeout_warned = True
            logger.warning(
                "collective_timeout %.1f s is under %.0fx the median step time (%.2f s): a replica "
                "that is only slow will have healthy steps discarded; raise collective_timeout",
                timeout,
                TIMEOUT_STEP_MULTIPLE,
                median,
            )

    def _update(self, before_update: Callable[[], None] | None) -> None:
        if before_update is not None:
            before_update()
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def close(self) -> None:
        """Shut down the Manager (server, transport, executor), the process group, the collective
        watchdog and the store."""
        if self._closed:
            return
        self._closed = True
        self.reducer.close()
        self.manager.shutdown(wait=False)
        self.pg.shutdown()
        self.recovery.watchdog.close()
        self._store = None

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
