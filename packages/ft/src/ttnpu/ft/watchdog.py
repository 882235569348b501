"""A collective watchdog whose timers belong to one step.

Each step opens a new *generation*; a timer armed in generation g fires its callback only if the
watchdog is still in generation g and the timer was not disarmed. A timeout left over from a
committed (or discarded) step therefore can never stop the next one, even if its thread was late.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CollectiveWatchdog", "WatchdogToken"]


@dataclass(frozen=True)
class WatchdogToken:
    generation: int
    serial: int
    label: str


class CollectiveWatchdog:
    """Timers around collectives; ``on_timeout(token)`` runs in a timer thread on a live expiry.

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
        self._active: dict[WatchdogToken, threading.Timer] = {}
        self.fired: list[WatchdogToken] = []
        self.stale_expiries = 0

    @property
    def generation(self) -> int:
        return self._generation

    def new_generation(self) -> int:
        """Retire every armed timer (cancelled, and ignored should one still fire)."""
        with self.lock:
            for timer in self._active.values():
                timer.cancel()
            self._active.clear()
            self._generation += 1
            return self._generation

    def arm(self, label: str, timeout_s: float | None = None) -> WatchdogToken:
        """Start a timer of ``timeout_s`` seconds (None: the watchdog's own timeout)."""
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"CollectiveWatchdog.arm: timeout_s must be > 0, got {timeout_s}")
        with self.lock:
            self._serial += 1
            token = WatchdogToken(self._generation, self._serial, label)
            timer = threading.Timer(
                self.timeout_s if timeout_s is None else timeout_s, self._expire, args=(token,)
            )
            timer.daemon = True
            self._active[token] = timer
            timer.start()
            return token

    def disarm(self, token: WatchdogToken) -> None:
        with self.lock:
            timer = self._active.pop(token, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, token: WatchdogToken) -> None:
        with self.lock:
            timer = self._active.pop(token, None)
            if token.generation != self._generation or timer is None:
                self.stale_expiries += 1
                return
            self.fired.append(token)
            self._on_timeout(token)
