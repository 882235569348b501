"""A collective watchdog whose timers belong to one step.

Each step opens a new *generation*; a timer armed in generation g fires its callback only if the
watchdog is still in generation g and the timer was not disarmed. A timeout left over from a
committed (or discarded) step therefore can never stop the next one, even if its expiry was late.

One daemon thread serves every timer (a deadline heap, as torch's own collective watchdog is one
thread): a step arms and disarms a few timers, and a thread started per timer cost 0.1-0.5 ms
each on the step's critical path. Arming wakes the thread only when the new deadline is the
earliest; disarming only forgets the timer, whose heap entry is dropped when it comes due.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CollectiveWatchdog", "WatchdogToken"]


@dataclass(frozen=True)
class WatchdogToken:
    generation: int
    serial: int
    label: str


class CollectiveWatchdog:
    """Timers around collectives; ``on_timeout(token)`` runs in the watchdog's thread on a live
    expiry.

    ``lock`` is held while the expiry is checked and the callback runs; the optimizer update holds
    the same lock, so an update that has started is never interrupted, and ``new_generation()``
    (called under the lock after the update) retires every timer of that step.
    """

    def __init__(
        self,
        timeout_s: float,
        on_timeout: Callable[[WatchdogToken], None],
        lock: threading.RLock | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"CollectiveWatchdog: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self.lock = lock if lock is not None else threading.RLock()
        self._generation = 0
        self._serial = 0
        # Under _due (taken after `lock` when both are held): the armed timers, their deadlines.
        self._due = threading.Condition(threading.Lock())
        self._live: set[WatchdogToken] = set()
        self._heap: list[tuple[float, int, WatchdogToken]] = []
        self._wake_at = float("inf")  # the deadline the thread sleeps until
        self._closed = False
        self._thread: threading.Thread | None = None
        self.fired: list[WatchdogToken] = []
        self.stale_expiries = 0

    @property
    def generation(self) -> int:
        return self._generation

    def new_generation(self) -> int:
        """Retire every armed timer (forgotten, and ignored should one be expiring now)."""
        with self.lock:
            with self._due:
                self._live.clear()
                self._heap.clear()
            self._generation += 1
            return self._generation

    def arm(self, label: str, timeout_s: float | None = None) -> WatchdogToken:
        """Start a timer of ``timeout_s`` seconds (None: the watchdog's own timeout)."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"CollectiveWatchdog.arm: timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self.lock:
            self._serial += 1
            token = WatchdogToken(self._generation, self._serial, label)
            with self._due:
                if self._closed:
                    raise RuntimeError("CollectiveWatchdog.arm after close()")
                self._live.add(token)
                heapq.heappush(self._heap, (deadline, token.serial, token))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="ttnpu-ft-watchdog", daemon=True
                    )
                    self._thread.start()
                elif deadline < self._wake_at:
                    self._due.notify()
            return token

    def disarm(self, token: WatchdogToken) -> None:
        with self._due:
            self._live.discard(token)

    def close(self) -> None:
        """Stop the thread; armed timers never fire."""
        with self._due:
            self._closed = True
            self._live.clear()
            self._due.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._due:
                expired = self._wait_for_expiries()
                if expired is None:
                    return
            for token in expired:
                self._expire(token)

    def _wait_for_expiries(self) -> list[WatchdogToken] | None:
        """Under ``_due``: sleep until a live timer is due (None once closed)."""
        while not self._closed:
            now = time.monotonic()
            expired = []
            while self._heap and self._heap[0][0] <= now:
                token = heapq.heappop(self._heap)[2]
                if token in self._live:  # a disarmed timer's entry is just dropped
                    expired.append(token)
            if expired:
                self._wake_at = float("inf")
                return expired
            self._wake_at = self._heap[0][0] if self._heap else float("inf")
            self._due.wait(None if not self._heap else self._wake_at - now)
        return None

    def _expire(self, token: WatchdogToken) -> None:
        with self.lock:
            with self._due:
                live = token in self._live
                self._live.discard(token)
            if token.generation != self._generation or not live:
                self.stale_expiries += 1
                return
            self.fired.append(token)
            self._on_timeout(token)
