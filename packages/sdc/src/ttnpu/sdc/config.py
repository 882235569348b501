"""Settings of the gradient detector and of the native NPU detectors, in torch_npu's terms.

The keys and defaults are those of torch_npu's ``NPU_ASD_CONFIG`` (times in minutes), so one
:class:`SDCConfig` drives both this package's detectors and, on Ascend, the native ones
(:meth:`SDCConfig.npu_env`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["SDCConfig"]


@dataclass(frozen=True)
class SDCConfig:
    """Gradient feature-value detection and escalation settings (times in minutes).

    ``upper_thresh1`` (jump) and ``upper_thresh2`` (absolute) multiply the bias-corrected EMA of
    the squared max-norm; ``cooldown`` is both the minimum time between two counted anomalies and
    how long escalated checksums stay on; ``strikes_num`` counted anomalies within
    ``strikes_window`` make a strike; escalations are at least ``checksum_cooldown`` apart;
    ``grad_sample_interval`` = N watches every Nth eligible parameter; ``warmup_steps`` normal
    observations are needed before the thresholds apply. ``hccl_mode`` 1-3 turns on torch_npu's
    native HCCL feature-value check (``NPU_ASD_ENABLE``) on Ascend; 0 leaves it off.
    """

    gradient_enabled: bool = True
    with_checksum: bool = True
    hccl_mode: int = 0
    cooldown: int = 5
    strikes_num: int = 3
    strikes_window: int = 480
    checksum_cooldown: int = 180
    upper_thresh1: int = 1_000_000
    upper_thresh2: int = 100
    grad_sample_interval: int = 3
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            expected = bool if f.type in ("bool", bool) else int
            if type(value) is not expected:
                raise TypeError(
                    f"SDCConfig.{f.name} must be {expected.__name__}, got {value!r} "
                    f"({type(value).__name__})"
                )
        minimum = {"upper_thresh1": 3, "upper_thresh2": 3, "hccl_mode": 0}
        for name in (
            "cooldown",
            "strikes_num",
            "strikes_window",
            "checksum_cooldown",
            "grad_sample_interval",
            "warmup_steps",
            *minimum,
        ):
            low = minimum.get(name, 1)
            if getattr(self, name) < low:
                raise ValueError(f"SDCConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.hccl_mode > 3:
            raise ValueError(f"SDCConfig.hccl_mode must be 0-3, got {self.hccl_mode}")
        if self.with_checksum and not self.gradient_enabled:
            raise ValueError("SDCConfig.with_checksum needs gradient_enabled (strikes escalate)")

    def npu_env(self) -> dict[str, str]:
        """``NPU_ASD_CONFIG`` / ``NPU_ASD_ENABLE`` values equivalent to these settings."""
        env: dict[str, str] = {}
        if self.gradient_enabled:
            keys = (
                "cooldown",
                "strikes_num",
                "strikes_window",
                "checksum_cooldown",
                "upper_thresh1",
                "upper_thresh2",
                "grad_sample_interval",
            )
            items = ["enable:true", f"with_checksum:{str(self.with_checksum).lower()}"]
            env["NPU_ASD_CONFIG"] = ",".join(items + [f"{k}:{getattr(self, k)}" for k in keys])
        if self.hccl_mode:
            env["NPU_ASD_ENABLE"] = str(self.hccl_mode)
        return env
