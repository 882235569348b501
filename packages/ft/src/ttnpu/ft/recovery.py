"""In-process recovery of a failed step, the same sequence on every device.

On a collective timeout (the watchdog) or a device-side failure: stop the device work, abort the
communicators, clean the training site, restart the device, and let the step be voted as failed.
The optimizer update runs under the same lock as the timeout handler, so it is never interrupted;
too many recoveries in a row end the run with a clear error instead of looping.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from torchft.process_group import ProcessGroup

from ttnpu.ft.devices import DeviceAdapter
from ttnpu.ft.training_site import SiteCleanup, clean_training_site
from ttnpu.ft.watchdog import CollectiveWatchdog, WatchdogToken

__all__ = ["CollectiveTimeout", "RecoveryLimitExceeded", "StepRecovery"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Substrings of device errors that mean "the step was stopped", not "the program is wrong".
_STOPPED_MARKERS = ("FORCE STOP", "HCCL", "NCCL", "Connection closed by peer", "aborted")


class CollectiveTimeout(RuntimeError):
    """A collective of the current step did not finish within its timeout."""


class StaleProcessGroup(RuntimeError):
    """The quorum's members are not those the cross-replica process group was built for."""


class RecoveryLimitExceeded(RuntimeError):
    """More consecutive in-process recoveries than allowed: the fault is not transient."""


class StepRecovery:
    """Watchdog, device stop/restart and training-site cleanup for one replica."""

    def __init__(
        self,
        adapter: DeviceAdapter,
        pg: ProcessGroup,
        model: torch.nn.Module,
        optimizers: tuple[torch.optim.Optimizer, ...],
        *,
        collective_timeout: timedelta,
        max_consecutive_recoveries: int = 3,
    ) -> None:
        if max_consecutive_recoveries < 0:
            raise ValueError(
                f"max_consecutive_recoveries must be >= 0, got {max_consecutive_recoveries}"
            )
        self.adapter = adapter
        self.pg = pg
        self.model = model
        self.optimizers = optimizers
        self.max_consecutive_recoveries = max_consecutive_recoveries
        self.lock = threading.RLock()
        self.watchdog = CollectiveWatchdog(
            collective_timeout.total_seconds(), self._on_timeout, self.lock
        )
        self.consecutive_recoveries = 0
        self.total_recoveries = 0
        self._stopped: WatchdogToken | None = None
        self._updating = False

    # -- timer thread ----------------------------------------------------------------------------
    def _on_timeout(self, token: WatchdogToken) -> None:
        """Runs under the lock, only for a live timer of the current step: stop and abort."""
        if self._updating:  # cannot happen (the update holds the lock); belt and braces
            return
        logger.error("collective %r timed out; stopping device work", token.label)
        self._stopped = token
        self.adapter.stop_device()
        self.adapter.abort_communicators(self.pg)

    # -- training thread -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Open a new generation: no timer of an earlier step can act on this one."""
        with self.lock:
            self.watchdog.new_generation()
            self._stopped = None

    def guard(self, label: str, fn: Callable[[], T], timeout: timedelta | None = None) -> T:
        """Run a collective (or a whole forward/backward) under a watchdog timer.

        ``timeout`` None: the collective timeout.
        """
        token = self.watchdog.arm(label, None if timeout is None else timeout.total_seconds())
        try:
            result = fn()
        finally:
            self.watchdog.disarm(token)
        if self._stopped is not None:
            raise CollectiveTimeout(f"{self._stopped.label} timed out; the step was stopped")
        return result

    def wait_collectives(self, label: str, wait: Callable[[], None]) -> None:
        """Wait for collectives, then for the current stream, under one timer.

        On NCCL and HCCL a work's ``wait()`` only makes the current stream wait: the host would
        first block on the data later, in whatever reads it (the reduction check), outside any
        timer, and a hung collective would be left to the backend's own, longer watchdog. The
        stream synchronisation (a no-op on CPU, where gloo's ``wait()`` blocks) makes it this
        timer's to stop; other streams (a checkpoint's staging copies) are not waited for.
        """

        def waited() -> None:
            wait()
            self.adapter.synchronize_stream()

        self.guard(label, waited)

    @property
    def stopped(self) -> bool:
        """Whether the watchdog stopped this step's device work."""
        return self._stopped is not None

    def is_recoverable(self, error: BaseException) -> bool:
        """A stopped/aborted step is recoverable; an error in user code is not."""
        if isinstance(error, CollectiveTimeout | StaleProcessGroup) or self._stopped is not None:
            return True
        return isinstance(error, RuntimeError) and any(m in str(error) for m in _STOPPED_MARKERS)

    def recover(self, error: BaseException) -> SiteCleanup:
        """Bring the replica back to the state of its last committed step (not yet voted)."""
        with self.lock:
            self.consecutive_recoveries += 1
            self.total_recoveries += 1
            if self.consecutive_recoveries > self.max_consecutive_recoveries:
                raise RecoveryLimitExceeded(
                    f"{self.consecutive_recoveries} consecutive step recoveries (limit "
                    f"{self.max_consecutive_recoveries}); last error: {error!r}"
                ) from error
            if self._stopped is None:
                self.adapter.stop_device()
                self.adapter.abort_communicators(self.pg)
            cleanup = clean_training_site(self.model, self.optimizers)
            self.adapter.restart_device()
            self.adapter.empty_cache()
            self.watchdog.new_generation()
            self._stopped = None
            logger.warning("recovered in process from %r (%s)", error, cleanup)
            return cleanup

    def discard(self) -> SiteCleanup:
        """A step voted down without a device fault: only the training site needs cleaning."""
        with self.lock:
            self.watchdog.new_generation()
            return clean_training_site(self.model, self.optimizers)

    def apply_update(self, update: Callable[[], None]) -> None:
        """Run the optimizer update; no timeout can interrupt it; it retires the step's timers."""
        with self.lock:
            self._updating = True
            try:
                update()
                self.adapter.synchronize()
            finally:
                self._updating = False
                self.watchdog.new_generation()
            self.consecutive_recoveries = 0
