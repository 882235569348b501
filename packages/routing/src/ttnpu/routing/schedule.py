"""The anticipatory-routing schedule: NORMAL -> WARMUP -> ACTIVE -> DRAIN -> NORMAL.

After a rollback, ``trigger()`` enters WARMUP: the routes of the next ``delay_steps`` steps are
captured with the restored parameters. Each ACTIVE step first captures one new step ahead, then
trains on the oldest cached one, replaying its routes; DRAIN trains on what is left without
capturing; NORMAL routes live. The routes used at step t were thus computed ``lag`` updates
earlier, with ``lag`` in ``0 .. delay_steps`` (it ramps up over the first steps, then stays at
``delay_steps``); ``delay_steps = 0`` reproduces normal training exactly.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import torch

from ttnpu.routing.cache import RouteCache
from ttnpu.routing.data import PeekableIterator
from ttnpu.routing.routers import RouteReplayError, RouterSet

B = TypeVar("B")


class DataExhaustedError(RuntimeError):
    """The data source has no full optimizer step left."""


class Phase(enum.Enum):
    NORMAL = "normal"
    WARMUP = "warmup"
    ACTIVE = "active"
    DRAIN = "drain"


@dataclass(frozen=True)
class ScheduleConfig:
    """``delay_steps`` is Δt (steps captured ahead); ``active_steps`` the ACTIVE updates.

    ``stop_after_last_router`` cuts the capture forward short with an exception from the last
    router's hook (FSDP2 is reset after it, see :meth:`RouterSet.capture`); turn it off for a
    wrapper that cannot recover from an exception in the middle of its forward.
    """

    delay_steps: int = 16
    active_steps: int = 500
    microbatches: int = 1
    stop_after_last_router: bool = True

    def __post_init__(self) -> None:
        for name, low in (("delay_steps", 0), ("active_steps", 1), ("microbatches", 1)):
            if getattr(self, name) < low:
                raise ValueError(
                    f"ScheduleConfig.{name} must be >= {low}, got {getattr(self, name)}"
                )


@dataclass
class _Queued:
    step: int
    captured_at: int


@dataclass
class TrainingStep(Generic[B]):
    """The micro-batches of one optimizer step and, while anticipatory, their cached routes.

    Wrap the forward and backward of micro-batch ``i`` in ``replay(i)``; in NORMAL it is a no-op.
    """

    step: int
    phase: Phase
    microbatches: list[B]
    captured_at: int | None
    _routers: RouterSet = field(repr=False)
    _cache: RouteCache | None = field(repr=False)
    _replayed: set[int] = field(default_factory=set, repr=False)

    @property
    def lag(self) -> int | None:
        """Optimizer updates between the parameters that routed and those that train."""
        return None if self.captured_at is None else self.step - 1 - self.captured_at

    def replay(self, i: int) -> AbstractContextManager[None]:
        if not 0 <= i < len(self.microbatches):
            raise IndexError(f"step {self.step} has micro-batches 0..{len(self.microbatches) - 1}")
        if self._cache is None:
            return nullcontext()
        return self._replay(i, self._cache.get(self.step, i))

    @contextmanager
    def _replay(self, i: int, routes: dict[str, torch.Tensor]) -> Iterator[None]:
        with self._routers.replay(routes):
            yield
        self._replayed.add(i)


class AnticipatorySchedule(Generic[B]):
    """Drives capture and replay for a hand-written (or torchtitan) training loop.

    ``forward(batch)`` is the capture forward of one micro-batch (it may skip the loss; capture
    stops after the last router anyway). ``step`` counts completed optimizer updates. Save the
    data iterator (``schedule.data``) as the dataloader state: it reports the position of the
    next batch to train on, not of the batches read ahead. Checkpoint saving is meant only in
    NORMAL (``checkpoint_allowed``), but ``state_dict()`` resumes from any phase.
    """

    def __init__(
        self,
        routers: RouterSet,
        data: PeekableIterator[B],
        forward: Callable[[B], object],
        config: ScheduleConfig | None = None,
        *,
        step: int = 0,
    ) -> None:
        self.routers = routers
        self.data = data
        self.forward = forward
        self.config = config or ScheduleConfig()
        self.step = step
        self.phase = Phase.NORMAL
        self.active_left = 0
        self.cache = RouteCache(routers.specs())
        self._queue: list[_Queued] = []
        self._current: TrainingStep[B] | None = None

    @property
    def checkpoint_allowed(self) -> bool:
        """False outside NORMAL: data is read ahead of the parameters and routes are cached."""
        return self.phase is Phase.NORMAL

    @property
    def queued_steps(self) -> list[int]:
        return [q.step for q in self._queue]

    def trigger(self) -> None:
        """Start anticipatory routing (after a rollback): NORMAL -> WARMUP."""
        if self.phase is not Phase.NORMAL:
            raise RuntimeError(
                f"trigger: anticipatory routing is already on (phase {self.phase.name})"
            )
        self.phase = Phase.WARMUP
        self.active_left = self.config.active_steps

    def warm_up(self, steps: int | None = None) -> None:
        """Capture up to ``steps`` more steps ahead (default: fill the window); then ACTIVE."""
        if self.phase is not Phase.WARMUP:
            raise RuntimeError(f"warm_up: only in WARMUP, not {self.phase.name}")
        todo = self.config.delay_steps - len(self._queue)
        for _ in range(todo if steps is None else min(steps, todo)):
            if not self._capture_next():
                break
        if len(self._queue) == self.config.delay_steps or steps is None:
            self.phase = Phase.ACTIVE

    def next_step(self) -> TrainingStep[B]:
        """The micro-batches (and routes) of the next optimizer step, step ``self.step + 1``."""
        if self._current is not None:
            raise RuntimeError(f"next_step: step {self._current.step} was not finished")
        if self.phase is Phase.WARMUP:
            self.warm_up()
        if self.phase is Phase.ACTIVE and not self._capture_next():
            self._end_active()
        step = self.step + 1
        mbs = self._take(step)
        if not self._queue:
            self._current = TrainingStep(step, self.phase, mbs, None, self.routers, None)
            return self._current
        head = self._queue.pop(0)
        if head.step != step:
            raise RuntimeError(f"schedule: queue head is step {head.step}, training step {step}")
        if not 0 <= self.step - head.captured_at <= self.config.delay_steps:
            raise RuntimeError(
                f"schedule: routes of step {step} are {self.step - head.captured_at} updates "
                f"stale, outside 0..{self.config.delay_steps}"
            )
        self._current = TrainingStep(
            step, self.phase, mbs, head.captured_at, self.routers, self.cache
        )
        return self._current

    def finish_step(self) -> None:
        """After the optimizer update of the current step was committed."""
        current = self._current
        if current is None:
            raise RuntimeError("finish_step: no step in progress (call next_step first)")
        if current._cache is not None:
            if missing := sorted(set(range(len(current.microbatches))) - current._replayed):
                raise RouteReplayError(
                    f"step {current.step}: micro-batches {missing} were not run under replay(i)"
                )
            self.cache.drop(current.step)
        self._current = None
        self.step += 1
        if self.phase is Phase.ACTIVE:
            self.active_left -= 1
            if self.active_left == 0:
                self._end_active()
        elif self.phase is Phase.DRAIN and not self._queue:
            self.phase = Phase.NORMAL

    def abandon_step(self) -> None:
        """Forget a failed step: drop every cached route and return to NORMAL (live routing)."""
        self._current = None
        self._queue.clear()
        self.cache.clear()
        self.active_left = 0
        self.phase = Phase.NORMAL

    def follow(self, started_at: int) -> None:
        """Take up the anticipatory routing that the other replicas entered when they rolled back
        to step ``started_at`` (their ``trigger()``), in a replica that has just healed from them
        and stands at ``self.step``: the phase they are in now, with as many steps queued. The
        phases are a function of the step (ACTIVE for ``started_at + 1 .. + active_steps``, then
        DRAIN for ``delay_steps``), so every replica checkpoints at the same steps again. The
        queued routes are captured now, with the healed parameters: this replica never held the
        older ones, so its routes are fresher than the others' (lag 0)."""
        if self._current is not None:
            raise RuntimeError(f"follow: step {self._current.step} is in progress")
        if started_at > self.step:
            raise ValueError(f"follow: started at step {started_at}, after step {self.step}")
        self.abandon_step()
        active_end = started_at + self.config.active_steps
        drain_end = active_end + self.config.delay_steps
        if self.step >= drain_end:
            return
        if self.step == started_at:
            self.trigger()
            return
        if self.step < active_end:
            self.phase, self.active_left = Phase.ACTIVE, active_end - self.step
            ahead = self.config.delay_steps
        else:
            self.phase, ahead = Phase.DRAIN, drain_end - self.step
        while len(self._queue) < ahead and self._capture_next():
            pass
        if self.phase is Phase.DRAIN and not self._queue:
            self.phase = Phase.NORMAL

    def _end_active(self) -> None:
        self.active_left = 0
        self.phase = Phase.DRAIN if self._queue else Phase.NORMAL

    def _take(self, step: int) -> list[B]:
        mbs = [item for _, item in zip(range(self.config.microbatches), self.data, strict=False)]
        if len(mbs) < self.config.microbatches:
            raise DataExhaustedError(
                f"data ended before the {self.config.microbatches} micro-batches of step {step}"
            )
        return mbs

    def _capture_next(self) -> bool:
        """Capture the step after the last queued one; False if the data has no full step left."""
        n = self.config.microbatches
        ahead = self.data.peek(n * (len(self._queue) + 1))
        if len(ahead) < n * (len(self._queue) + 1):
            return False
        step = self.step + len(self._queue) + 1
        batch = ahead[-n:]
        stop = self.config.stop_after_last_router
        captured = [
            self.routers.capture(_bind(self.forward, mb), stop_after_last_router=stop)
            for mb in batch
        ]
        self.cache.put(step, captured)
        self._queue.append(_Queued(step, self.step))
        return True

    def state_dict(self) -> dict[str, Any]:
        """Phase, counters and cached routes (the data position is ``self.data.state_dict()``)."""
        if self._current is not None:
            raise RuntimeError(f"state_dict: step {self._current.step} is in progress")
        return {
            "config": asdict(self.config),
            "phase": self.phase.value,
            "step": self.step,
            "active_left": self.active_left,
            "queue": [[q.step, q.captured_at] for q in self._queue],
            "routes": self.cache.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` in any phase; nothing changes if the state is bad."""
        if state.get("config") != asdict(self.config):
            raise ValueError(
                f"AnticipatorySchedule.load_state_dict: saved config {state.get('config')} "
                f"differs from {asdict(self.config)}"
            )
        try:
            phase = Phase(state["phase"])
            step, active_left = int(state["step"]), int(state["active_left"])
            queue = [_Queued(int(s), int(c)) for s, c in state["queue"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"AnticipatorySchedule.load_state_dict: malformed ({error!r})"
            ) from None
        consistent = {
            Phase.NORMAL: not queue and active_left == 0,
            Phase.WARMUP: active_left > 0 and len(queue) <= self.config.delay_steps,
            Phase.ACTIVE: active_left > 0,
            Phase.DRAIN: bool(queue) and active_left == 0,
        }[phase]
        if not consistent:
            raise ValueError(
                f"AnticipatorySchedule.load_state_dict: phase {phase.name} with {len(queue)} "
                f"queued steps and {active_left} active steps left is not a state it can be in"
            )
        cache = RouteCache(self.routers.specs())
        cache.load_state_dict(state["routes"], device=_device_of(self.routers))
        if [q.step for q in queue] != cache.steps or [q.step for q in queue] != list(
            range(step + 1, step + 1 + len(queue))
        ):
            raise ValueError(
                f"AnticipatorySchedule.load_state_dict: queued steps {[q.step for q in queue]} "
                f"and cached steps {cache.steps} do not follow step {step}"
            )
        self.phase, self.step, self.active_left = phase, step, active_left
        self._queue, self.cache, self._current = queue, cache, None


def _bind(forward: Callable[[B], object], batch: B) -> Callable[[], object]:
    return lambda: forward(batch)


def _device_of(routers: RouterSet) -> torch.device:
    params: Iterator[torch.Tensor] = routers.model.parameters()
    first = next(params, None)
    return first.device if first is not None else torch.device("cpu")
