"""One event type for every detector, a JSON-lines log and the pluggable actions a trainer chooses.

A detector builds an :class:`SDCEvent` and hands it to a :class:`Reporter`, which runs the actions
in order. The default actions log and then raise :class:`SDCError`: a detection that only logs is a
choice the caller makes by passing ``actions=`` explicitly. A trainer that vetoes a commit instead
uses :class:`VetoFlag` (poll it before committing) or any callable.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch.distributed as dist

__all__ = [
    "Action",
    "EventKind",
    "EventLog",
    "LogAction",
    "RaiseAction",
    "Reporter",
    "SDCError",
    "SDCEvent",
    "VetoFlag",
    "default_reporter",
    "set_default_reporter",
]

logger = logging.getLogger("ttnpu.sdc")

EventKind = Literal["matmul", "gradient", "gradient_strikes", "collective"]
Detail = Mapping[str, float | int | str | bool | None]


@dataclass(frozen=True)
class SDCEvent:
    """A detection: what was checked, where (rank, step, site), by how much, and if it is proven.

    ``magnitude`` is the observed error divided by the bound it was judged against (> 1 means
    beyond the bound). ``confirmed`` is True when recomputation or a deterministic bound proves the
    result wrong; a statistical anomaly (gradient spike) is reported unconfirmed.
    """

    kind: EventKind
    where: str
    rank: int
    step: int | None
    magnitude: float
    confirmed: bool
    detail: Detail = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"detail": dict(self.detail)}, sort_keys=True, default=str)


class SDCError(RuntimeError):
    """Raised by :class:`RaiseAction`; carries the event."""

    def __init__(self, event: SDCEvent) -> None:
        super().__init__(
            f"silent data corruption: {event.kind} at {event.where} on rank {event.rank}, "
            f"step {event.step}, error/bound {event.magnitude:.3g}, confirmed={event.confirmed}"
        )
        self.event = event


Action = Callable[[SDCEvent], None]


class LogAction:
    """Log the event (WARNING when confirmed, INFO otherwise) to the ``ttnpu.sdc`` logger."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._log = log or logger

    def __call__(self, event: SDCEvent) -> None:
        level = logging.WARNING if event.confirmed else logging.INFO
        self._log.log(level, "SDC %s", event.to_json())


class RaiseAction:
    """Raise :class:`SDCError`; with ``confirmed_only`` an unconfirmed event passes silently."""

    def __init__(self, *, confirmed_only: bool = False) -> None:
        self.confirmed_only = confirmed_only

    def __call__(self, event: SDCEvent) -> None:
        if event.confirmed or not self.confirmed_only:
            raise SDCError(event)


class VetoFlag:
    """Remember events until the trainer asks; ``take()`` returns them and clears the flag.

    A torchft trainer calls ``take()`` before ``should_commit`` and votes against the commit when
    the list is not empty.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[SDCEvent] = []

    def __call__(self, event: SDCEvent) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def vetoed(self) -> bool:
        with self._lock:
            return bool(self._events)

    def take(self) -> list[SDCEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class EventLog:
    """Append every event as one JSON line to ``path`` (flushed per event, so a crash keeps it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def __call__(self, event: SDCEvent) -> None:
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(event.to_json() + "\n")

    def read(self) -> list[dict[str, object]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line]


class Reporter:
    """Stamp events with rank and step, then run the actions in order (an action may raise).

    ``step`` is set by the caller (or by :class:`~ttnpu.sdc.GradientDetector` at each optimizer
    step); ``rank`` defaults to the default process group's rank, 0 without one.
    """

    def __init__(self, actions: Iterable[Action] | None = None, *, rank: int | None = None) -> None:
        self.actions: list[Action] = (
            list(actions) if actions is not None else [LogAction(), RaiseAction()]
        )
        self.rank = rank
        self.step: int | None = None
        self.count = 0

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def report(
        self,
        kind: EventKind,
        where: str,
        *,
        magnitude: float,
        confirmed: bool,
        detail: Detail | None = None,
        rank: int | None = None,
    ) -> SDCEvent:
        event = SDCEvent(
            kind=kind,
            where=where,
            rank=self._rank() if rank is None else rank,
            step=self.step,
            magnitude=float(magnitude),
            confirmed=confirmed,
            detail=dict(detail or {}),
        )
        self.count += 1
        for action in self.actions:
            action(event)
        return event


_default = Reporter()


def default_reporter() -> Reporter:
    """The reporter used by detectors built without one (and by the compiled checksum op)."""
    return _default


def set_default_reporter(reporter: Reporter) -> Reporter:
    """Replace the default reporter; returns the previous one."""
    global _default
    previous, _default = _default, reporter
    return previous
