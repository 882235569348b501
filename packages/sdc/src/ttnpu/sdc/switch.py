"""The run-time switch that gates every matmul checksum, eager and compiled.

The compiled graph always contains the checksum ops; each call asks this switch whether to work, so
turning checks on or off (by hand, or by gradient-statistics escalation for a cooldown) never
recompiles. Sampling (check every Nth matmul) lives here too, so both modes sample alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["ChecksumSwitch", "checksum_switch"]


class ChecksumSwitch:
    """On, off, or on until a deadline; ``should_check()`` also applies ``sample_every``."""

    def __init__(
        self,
        *,
        on: bool = True,
        sample_every: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self._lock = threading.Lock()
        self._on = on
        self._until: float | None = None
        self._clock = clock
        self.sample_every = sample_every
        self._calls = 0

    def on(self) -> None:
        with self._lock:
            self._on, self._until = True, None

    def off(self) -> None:
        with self._lock:
            self._on, self._until = False, None

    def on_for(self, seconds: float) -> None:
        """Turn checks on for ``seconds`` (escalation); an unbounded ``on()`` is not shortened."""
        with self._lock:
            now = self._clock()
            if self._on and self._until is None:
                return
            self._on, self._until = True, now + seconds

    def is_on(self) -> bool:
        with self._lock:
            if self._until is not None and self._clock() >= self._until:
                self._on, self._until = False, None
            return self._on

    def should_check(self) -> bool:
        """True for every ``sample_every``-th call while on."""
        if not self.is_on():
            return False
        with self._lock:
            self._calls += 1
            return self._calls % self.sample_every == 0


checksum_switch = ChecksumSwitch()
"""The process-wide switch read by :class:`~ttnpu.sdc.ChecksumMode` and the compiled checks."""
