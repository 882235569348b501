"""Gradient feature-value detection: the squared max-norm of sampled gradients against its history.

Once per optimizer step, after the last micro-batch of a gradient-accumulation window, each sampled
parameter's local gradient shard gives ``val = max|g|^2``. Its history is an EMA (factor 0.99) with
bias correction; ``val`` is abnormal when it is NaN/Inf, or when it exceeds the jump threshold
``avg·upper_thresh1/(1-0.99^n)`` and differs from the previous value by as much; values above the
absolute threshold ``avg·upper_thresh2/(1-0.99^n)`` are kept out of the EMA. The rule, defaults and
strike policy follow torch_npu's detector, so both agree on what a spike is. Enough counted
anomalies in a window make a strike, which turns the matmul checksums on for a cooldown on every
rank (the strike flag is max-reduced across the group every few steps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .config import SDCConfig
from .events import Reporter, SDCEvent, default_reporter
from .switch import ChecksumSwitch, checksum_switch

__all__ = ["GradientDetector", "StrikePolicy"]

_EMA = 0.99


@dataclass
class _History:
    avg: float = 0.0
    pre_val: float = 0.0
    normal: int = 0


class StrikePolicy:
    """Count anomalies at least ``cooldown_s`` apart; ``strikes_num`` within ``window_s`` strike."""

    def __init__(
        self, *, cooldown_s: float, strikes_num: int, window_s: float, clock: Callable[[], float]
    ) -> None:
        self.cooldown_s, self.strikes_num, self.window_s = cooldown_s, strikes_num, window_s
        self._clock = clock
        self._counted: list[float] = []
        self._last: float | None = None

    def anomaly(self) -> bool:
        """Record an anomaly now; True when it completes a strike (the count then restarts)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.cooldown_s:
            return False
        self._last = now
        self._counted = [t for t in self._counted if now - t <= self.window_s] + [now]
        if len(self._counted) >= self.strikes_num:
            self._counted = []
            return True
        return False


def _local(grad: Tensor) -> Tensor:
    """The local shard of a DTensor gradient (FSDP2, TP), the gradient itself otherwise."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


class GradientDetector:
    """Watch sampled gradients once per optimizer step; report anomalies and strikes, escalate.

    Call :meth:`after_backward` after every successful micro-batch backward (before
    ``zero_grad``); it checks on the ``accumulation_steps``-th call. :meth:`discard` forgets the
    micro-batches of a step that is thrown away. ``group`` carries the escalation flag (default:
    the default process group when there is one); it is max-reduced every ``sync_every``
    optimizer steps, so every rank of the group must check in lockstep.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        config: SDCConfig | None = None,
        *,
        accumulation_steps: int = 1,
        reporter: Reporter | None = None,
        switch: ChecksumSwitch | None = None,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
        sync_every: int = 10,
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.config = config or SDCConfig()
        self.accumulation_steps = accumulation_steps
        self.reporter = reporter
        self.switch = switch or checksum_switch
        self.group = group
        self._clock = clock
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        self._pending = False
        seen: set[int] = set()
        eligible = []
        for name, p in named_parameters:
            if p.requires_grad and p.dim() >= 2 and id(p) not in seen:
                seen.add(id(p))
                eligible.append((name, p))
        interval = self.config.grad_sample_interval
        self.sampled: list[tuple[str, nn.Parameter]] = eligible[::interval]
        self._history = {name: _History() for name, _ in self.sampled}
        c = self.config
        self.policy = StrikePolicy(
            cooldown_s=60.0 * c.cooldown,
            strikes_num=c.strikes_num,
            window_s=60.0 * c.strikes_window,
            clock=clock,
        )
        self.microbatch = 0
        self.steps = 0
        self.escalations = 0
        self._last_escalation: float | None = None

    def after_backward(self) -> list[SDCEvent] | None:
        """Count a micro-batch; at the end of the accumulation window run :meth:`check`."""
        self.microbatch += 1
        if self.microbatch < self.accumulation_steps:
            return None
        self.microbatch = 0
        return self.check()

    def discard(self) -> None:
        """Forget the micro-batches counted so far (their step was discarded)."""
        self.microbatch = 0

    def _values(self) -> list[tuple[str, float]]:
        named = [(n, _local(p.grad)) for n, p in self.sampled if p.grad is not None]
        named = [(n, g) for n, g in named if g.numel() > 0]
        if not named:
            return []
        # aminmax is one fast pass; the inf-norm kernels are ~20x slower for bf16 on CPU.
        extremes = [torch.aminmax(g.detach()) for _, g in named]
        device = extremes[0].max.device
        maxima = torch.stack(
            [torch.maximum(-e.min, e.max).float().to(device) for e in extremes]
        ).tolist()
        return [(n, m * m) for (n, _), m in zip(named, maxima, strict=True)]

    def _judge(self, name: str, val: float) -> tuple[bool, float]:
        """torch_npu's rule; returns (abnormal, jump threshold)."""
        h = self._history[name]
        if not math.isfinite(val):
            return True, math.inf
        if val == 0.0:
            return False, 0.0
        if h.normal >= self.config.warmup_steps and h.avg != 0.0:
            correction = 1.0 - _EMA**h.normal
            thr1 = h.avg * self.config.upper_thresh1 / correction
            thr2 = h.avg * self.config.upper_thresh2 / correction
        else:
            thr1 = thr2 = val
        abnormal = val > thr1 and abs(val - h.pre_val) > thr1
        if not abnormal and val <= thr2:
            h.normal += 1
            h.avg = _EMA * h.avg + (1.0 - _EMA) * val
        h.pre_val = val
        return abnormal, thr1

    def check(self) -> list[SDCEvent]:
        """Judge every sampled gradient now; report anomalies, then a strike and escalation."""
        self.steps += 1
        anomalies = []
        for name, val in self._values():
            history = self._history[name]
            previous, average = history.pre_val, history.avg
            abnormal, thr1 = self._judge(name, val)
            if abnormal:
                anomalies.append((name, val, previous, average, thr1))
        # Anomalies of one step share a time stamp: the policy counts at most one of them.
        struck = bool(anomalies) and self.policy.anomaly()
        escalate = self._escalate(struck)
        reporter = self.reporter or default_reporter()
        events = []
        for name, val, previous, average, thr1 in anomalies:
            magnitude = val / thr1 if math.isfinite(val) and thr1 > 0 else math.inf
            detail = {
                "value": val,
                "previous": previous,
                "average": average,
                "threshold": thr1,
                "detector_step": self.steps,
            }
            events.append(
                reporter.report(
                    "gradient", name, magnitude=magnitude, confirmed=False, detail=detail
                )
            )
        if struck or escalate:
            detail = {
                "struck_here": struck,
                "checksums_on": escalate,
                "detector_step": self.steps,
                "anomalies": len(anomalies),
            }
            events.append(
                reporter.report(
                    "gradient_strikes", "gradients", magnitude=1.0, confirmed=False, detail=detail
                )
            )
        return events

    def _escalate(self, struck: bool) -> bool:
        """Max-reduce the strike flag over the group; on a strike turn checksums on for cooldown."""
        if not self.config.with_checksum:
            return False
        self._pending |= struck
        group = self.group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and self.sampled:
            if self.steps % self.sync_every:
                return False
            t = torch.tensor([float(self._pending)], device=self.sampled[0][1].device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            flag = bool(t.item())
        else:
            flag = self._pending
        self._pending = False
        now = self._clock()
        gap = 60.0 * self.config.checksum_cooldown
        if not flag or (self._last_escalation is not None and now - self._last_escalation < gap):
            return False
        self._last_escalation = now
        self.escalations += 1
        self.switch.on_for(60.0 * self.config.cooldown)
        return True
