"""LossSpikeDetector: injected spikes are found at their onset; clean curves raise nothing."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from ttnpu.routing import DetectorConfig, LossSpikeDetector

REAL = {
    int(k): v
    for k, v in json.loads(
        (Path(__file__).parent / "data" / "real_loss_curves.json").read_text()
    ).items()
}
SPIKE_AT = 250


def synthetic_curve(seed: int, steps: int = 400) -> list[float]:
    """A noisy power-law decay a + b (t + 10)^-alpha with 1-5 % multiplicative noise."""
    g = torch.Generator().manual_seed(seed)
    a, b, alpha, noise = (
        lo + (hi - lo) * torch.rand(1, generator=g).item()
        for lo, hi in ((1.5, 2.5), (4, 8), (0.3, 0.7), (0.01, 0.05))
    )
    t = torch.arange(steps, dtype=torch.float64)
    curve = (a + b * (t + 10) ** -alpha) * (
        1 + noise * torch.randn(steps, generator=g, dtype=torch.float64)
    )
    return curve.tolist()


CLEAN = {f"synthetic-{s}": synthetic_curve(s) for s in range(10)} | {
    f"real-{s}": c for s, c in REAL.items()
}


def run(curve: list[float], detector: LossSpikeDetector | None = None) -> list[tuple[int, int]]:
    """(trigger step, onset) of every trigger, one optimizer update per step."""
    detector = detector or LossSpikeDetector()
    triggers = []
    for step, loss in enumerate(curve):
        onset = detector.observe(step, loss)
        if onset is not None:
            triggers.append((step, onset))
        detector.record_optimizer_update()
    return triggers


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_curves_raise_nothing(name: str) -> None:
    assert run(CLEAN[name]) == []


def jump(curve: list[float]) -> list[float]:
    return [x * 5 if i == SPIKE_AT else x for i, x in enumerate(curve)]


def noise_scale(curve: list[float]) -> float:
    """Step-to-step noise before the spike: std of first differences / sqrt(2)."""
    before = torch.tensor(curve[SPIKE_AT - 100 : SPIKE_AT], dtype=torch.float64)
    return before.diff().std().item() / math.sqrt(2)


def ramp(curve: list[float]) -> list[float]:
    """Ten steps rising by 3 noise-sigmas each, then held."""
    rise = 3 * noise_scale(curve)
    return [
        x + rise * min(i - SPIKE_AT + 1, 10) if i >= SPIKE_AT else x for i, x in enumerate(curve)
    ]


def plateau(curve: list[float]) -> list[float]:
    """A lasting shift up by 10 noise-sigmas."""
    shift = 10 * noise_scale(curve)
    return [x + shift if i >= SPIKE_AT else x for i, x in enumerate(curve)]


@pytest.mark.parametrize(
    "name", ["synthetic-0", "synthetic-3", "synthetic-7", "real-0", "real-4", "real-9"]
)
@pytest.mark.parametrize("inject", [jump, ramp, plateau])
def test_injected_spike_found_at_its_onset(name: str, inject: object) -> None:
    assert callable(inject)
    triggers = run(inject(CLEAN[name]))
    assert len(triggers) == 1, triggers
    step, onset = triggers[0]
    assert SPIKE_AT <= step < SPIKE_AT + 10
    assert abs(onset - SPIKE_AT) <= 1, (step, onset)


def test_real_curves_are_reproducible_from_the_recorder() -> None:
    spec = importlib.util.spec_from_file_location(
        "recorder", Path(__file__).parent / "record_loss_curves.py"
    )
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    fresh = recorder.train_curve(0, 15)
    assert fresh == pytest.approx(REAL[0][:15], rel=1e-3)


def test_constant_loss_uses_a_relative_floor_not_zero_sigma() -> None:
    detector = LossSpikeDetector(DetectorConfig(warmup_steps=100))
    for step in range(100):
        assert detector.observe(step, 2.5) is None
    assert detector.score(2.5 + 1e-9) == pytest.approx(1e-9 / 2.5e-6, rel=1e-3)
    assert detector.observe(100, 2.5 + 1e-9) is None
    assert detector.observe(101, 3.0) == 101


def test_no_trigger_during_warmup() -> None:
    detector = LossSpikeDetector(DetectorConfig(warmup_steps=10))
    assert all(detector.observe(s, 1.0 if s != 5 else 100.0) is None for s in range(10))


def test_anomalous_points_are_held_out_then_a_plateau_is_absorbed() -> None:
    cfg = DetectorConfig(warmup_steps=50, z_threshold=100.0, onset_lookback=4, cooldown_steps=0)
    detector = LossSpikeDetector(cfg)
    g = torch.Generator().manual_seed(0)
    noise = (0.01 * torch.randn(300, generator=g)).tolist()
    for step in range(200):
        detector.observe(step, 2.0 + noise[step])
    sigma = math.sqrt(detector.var)
    level = detector.level
    frozen = []
    for step in range(200, 210):
        detector.observe(step, 2.0 + 4 * sigma)
        frozen.append(detector.frozen)
    assert frozen[:4] == [1, 2, 3, 4]
    assert detector.level > level  # accepted after 4 held-out steps
    for step in range(210, 260):
        detector.observe(step, 2.0 + 4 * sigma + noise[step])
    assert detector.frozen == 0
    assert detector.level == pytest.approx(2.0 + 4 * sigma, abs=3 * sigma)


def test_held_out_points_do_not_move_the_statistics() -> None:
    detector = LossSpikeDetector(DetectorConfig(warmup_steps=20, z_threshold=1e9, cooldown_steps=0))
    for step in range(100):
        detector.observe(step, 2.0 + 0.01 * math.sin(step))
    before = (detector.level, detector.trend, detector.var)
    detector.observe(100, 50.0)
    assert (detector.level, detector.trend, detector.var) == before


def test_cooldown_counts_committed_updates_and_survives_reset() -> None:
    detector = LossSpikeDetector(DetectorConfig(warmup_steps=10, cooldown_steps=5))

    def spike_after_warmup(start: int) -> int | None:
        detector.reset()
        for s in range(start, start + 10):
            assert detector.observe(s, 1.0) is None
        return detector.observe(start + 10, 10.0)

    assert spike_after_warmup(0) == 10
    for _ in range(5):
        detector.record_optimizer_update()
    assert detector.cooling_down()
    assert spike_after_warmup(100) is None  # exactly 5 updates: still cooling
    detector.record_optimizer_update()
    assert not detector.cooling_down()
    assert spike_after_warmup(200) == 210


def test_non_finite_loss_is_an_error() -> None:
    with pytest.raises(ValueError, match="non-finite training loss nan at step 3"):
        LossSpikeDetector().observe(3, float("nan"))


def test_accepts_a_tensor_loss() -> None:
    detector = LossSpikeDetector()
    detector.observe(0, torch.tensor(2.0))
    assert detector.level == 2.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("warmup_steps", 1),
        ("z_threshold", float("inf")),
        ("level_decay", 1.0),
        ("trend_decay", -0.1),
        ("onset_z_threshold", 7.0),
        ("onset_lookback", 0),
        ("cooldown_steps", -1),
    ],
)
def test_config_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"DetectorConfig.{field} must be"):
        DetectorConfig(**{field: value})  # type: ignore[arg-type]


def test_state_dict_round_trip_continues_identically() -> None:
    curve = jump(CLEAN["real-1"])
    a = LossSpikeDetector()
    for step in range(200):
        a.observe(step, curve[step])
        a.record_optimizer_update()
    b = LossSpikeDetector()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for step in range(200, 400):
        assert a.observe(step, curve[step]) == b.observe(step, curve[step])
        a.record_optimizer_update()
        b.record_optimizer_update()
    assert a.state_dict() == b.state_dict()


def test_failed_load_changes_nothing() -> None:
    detector = LossSpikeDetector()
    detector.observe(0, 2.0)
    before = detector.state_dict()
    other = LossSpikeDetector(DetectorConfig(z_threshold=5.0)).state_dict()
    with pytest.raises(ValueError, match="saved config"):
        detector.load_state_dict(other)
    broken = dict(before, level="x")
    with pytest.raises(ValueError, match="malformed"):
        detector.load_state_dict(broken)
    assert detector.state_dict() == before
