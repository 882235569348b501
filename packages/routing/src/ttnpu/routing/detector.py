"""Loss-spike detection: a Holt level+trend forecast of the loss and a robust z-score.

The trend matters: on a decaying loss curve a level-only forecast lags behind, inflating both the
residuals and the variance so that real spikes hide in it. Anomalous points are held out of the
statistics (for at most ``onset_lookback`` consecutive steps, then a plateau is accepted as the new
normal), and the onset is found by walking back through the newest run of anomalous points.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DetectorConfig:
    """Detector settings; the defaults are TorchTitan-NPU's (see the package README)."""

    warmup_steps: int = 100
    z_threshold: float = 6.0
    level_decay: float = 0.97
    trend_decay: float = 0.9
    onset_z_threshold: float = 2.0
    onset_lookback: int = 64
    cooldown_steps: int = 500

    def __post_init__(self) -> None:
        checks = (
            ("warmup_steps", self.warmup_steps >= 2, ">= 2"),
            ("z_threshold", math.isfinite(self.z_threshold) and self.z_threshold > 0, "> 0"),
            ("level_decay", 0 < self.level_decay < 1, "in (0, 1)"),
            ("trend_decay", 0 <= self.trend_decay < 1, "in [0, 1)"),
            (
                "onset_z_threshold",
                0 < self.onset_z_threshold <= self.z_threshold,
                "in (0, z_threshold]",
            ),
            ("onset_lookback", self.onset_lookback >= 1, ">= 1"),
            ("cooldown_steps", self.cooldown_steps >= 0, ">= 0"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"DetectorConfig.{name} must be {expected}, got {getattr(self, name)}"
                )


class LossSpikeDetector:
    """Feed it the globally reduced loss of every step; it returns the onset step of a spike.

    Give every rank the same (all-reduced) loss so that all ranks reach the same verdict without a
    collective of their own. ``record_optimizer_update()`` after every committed optimizer step
    drives the cooldown clock, which neither ``reset()`` nor a rollback rewinds.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self.completed_updates = 0
        self.last_trigger: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the loss statistics (after a rollback, or when normal routing resumes)."""
        self.count = 0
        self.level = 0.0
        self.trend = 0.0
        self.var = 0.0
        self.frozen = 0
        self.history: deque[tuple[int, float]] = deque(maxlen=self.config.onset_lookback)

    def record_optimizer_update(self) -> None:
        """Count one committed optimizer step (the unit of the cooldown)."""
        self.completed_updates += 1

    def cooling_down(self) -> bool:
        """Whether a trigger now would be suppressed by the cooldown."""
        if self.last_trigger is None:
            return False
        return self.completed_updates - self.last_trigger <= self.config.cooldown_steps

    def score(self, loss: float) -> float:
        """The z-score of ``loss`` against the current forecast (0 before any observation)."""
        if self.count == 0:
            return 0.0
        pred = self.level + self.trend
        sigma = math.sqrt(max(self.var, 0.0))
        floor = max(1e-12, 1e-6 * max(abs(loss), abs(pred)))
        return (loss - pred) / max(sigma, floor)

    def observe(self, step: int, loss: float | torch.Tensor) -> int | None:
        """Take the loss of ``step``; return the onset step if this observation triggers a spike."""
        value = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
        if not math.isfinite(value):
            raise ValueError(f"LossSpikeDetector: non-finite training loss {value} at step {step}")
        cfg = self.config
        z = self.score(value)
        anomalous = False
        onset: int | None = None
        if self.count >= cfg.warmup_steps:
            self.history.append((step, z))
            anomalous = z > cfg.onset_z_threshold
            if z > cfg.z_threshold and not self.cooling_down():
                onset = self._walk_back()
                self.last_trigger = self.completed_updates
        if anomalous and self.frozen < cfg.onset_lookback:
            self.frozen += 1
        else:
            if not anomalous:
                self.frozen = 0
            self._update(value)
        return onset

    def _walk_back(self) -> int:
        onset = self.history[-1][0]
        for step, z in reversed(self.history):
            if z <= self.config.onset_z_threshold:
                break
            onset = step
        return onset

    def _update(self, loss: float) -> None:
        cfg = self.config
        if self.count == 0:
            self.level, self.trend, self.var = loss, 0.0, 0.0
        else:
            residual = loss - (self.level + self.trend)
            level = (1 - cfg.level_decay) * loss + cfg.level_decay * (self.level + self.trend)
            self.trend = (1 - cfg.trend_decay) * (level - self.level) + cfg.trend_decay * self.trend
            self.level = level
            self.var = cfg.level_decay * (self.var + (1 - cfg.level_decay) * residual**2)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (a torchtitan/DCP ``Stateful`` can save them as they are)."""
        return {
            "config": asdict(self.config),
            "count": self.count,
            "level": self.level,
            "trend": self.trend,
            "var": self.var,
            "frozen": self.frozen,
            "history": [[s, z] for s, z in self.history],
            "completed_updates": self.completed_updates,
            "last_trigger": self.last_trigger,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the config must match, and nothing changes on an error."""
        if state.get("config") != asdict(self.config):
            raise ValueError(
                f"LossSpikeDetector.load_state_dict: saved config {state.get('config')} differs "
                f"from this detector's {asdict(self.config)}"
            )
        try:
            values = {
                "count": int(state["count"]),
                "level": float(state["level"]),
                "trend": float(state["trend"]),
                "var": float(state["var"]),
                "frozen": int(state["frozen"]),
                "completed_updates": int(state["completed_updates"]),
            }
            history = [(int(s), float(z)) for s, z in state["history"]]
            last = state["last_trigger"]
            last_trigger = None if last is None else int(last)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"LossSpikeDetector.load_state_dict: malformed state ({error!r})"
            ) from None
        for name, value in values.items():
            setattr(self, name, value)
        self.history = deque(history, maxlen=self.config.onset_lookback)
        self.last_trigger = last_trigger
