"""The run-time switch that gates every matmul checksum, eager and compiled.

The compiled graph always contains the checksum ops; each call asks this switch whether to work, so
turning checks on or off (by hand, or by gradient-statistics escalation for a cooldown) never
recompiles. Sampling lives here too, so both modes sample alike: of matmuls (every Nth call,
``sample_every``: a fraction of layers) and of steps (``sample_steps``: a fraction of steps, on
whatever the gradient statistics say, so a corruption that does not move them is still found).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

__all__ = ["BACKGROUND_SAMPLE_STEPS", "ChecksumSwitch", "checksum_switch"]

BACKGROUND_SAMPLE_STEPS = 0.01
"""The fraction of steps an escalation policy checks anyway (ttnpu-trainer's default): about
1% of the step time with the eager checks, a persistent fault seen within ~100 steps."""


class ChecksumSwitch:
    """On, off, or on until a deadline; ``should_check()`` also applies ``sample_every``.

    With ``sample_steps`` = r > 0, :meth:`begin_step` turns checks on for a pseudo-random
    fraction r of steps whatever the state: the choice is a function of (``seed``, step) only,
    so every rank and replica checks the same steps, and a re-run of a step is sampled again.
    """

    def __init__(
        self,
        *,
        on: bool = True,
        sample_every: int = 1,
        sample_steps: float = 0.0,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        if not 0.0 <= sample_steps <= 1.0:
            raise ValueError(f"sample_steps must be in [0, 1], got {sample_steps}")
        self._lock = threading.Lock()
        self._on = on
        self._until: float | None = None
        self._clock = clock
        self.sample_every = sample_every
        self.sample_steps = sample_steps
        self.seed = seed
        self._sampled = False
        self._calls = 0

    def step_sampled(self, step: int) -> bool:
        """Whether ``step`` is one of the background-sampled steps."""
        if self.sample_steps <= 0.0:
            return False
        return random.Random(self.seed * 1_000_003 + step).random() < self.sample_steps

    def begin_step(self, step: int) -> bool:
        """Enter ``step``: returns whether checks are on for it (on, escalated, or sampled)."""
        sampled = self.step_sampled(step)
        with self._lock:
            self._sampled = sampled
        return self.is_on()

    def on(self) -> None:
        with self._lock:
            self._on, self._until = True, None

    def off(self) -> None:
        """Checks off, escalation and the current step's sample included."""
        with self._lock:
            self._on, self._until, self._sampled = False, None, False

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
            return self._on or self._sampled

    def should_check(self) -> bool:
        """True for every ``sample_every``-th call while on."""
        if not self.is_on():
            return False
        with self._lock:
            self._calls += 1
            return self._calls % self.sample_every == 0


checksum_switch = ChecksumSwitch()
"""The process-wide switch read by :class:`~ttnpu.sdc.ChecksumMode` and the compiled checks."""
