from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ttnpu.sdc import (
    ChecksumSwitch,
    GradientDetector,
    Reporter,
    SDCConfig,
    StrikePolicy,
    VetoFlag,
    flip_bit,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _backward(model: nn.Module) -> None:
    model(torch.randn(8, 16)).pow(2).mean().backward()


def _detector(model: nn.Module, **kwargs: object) -> tuple[GradientDetector, VetoFlag]:
    flag = VetoFlag()
    config = kwargs.pop("config", SDCConfig(grad_sample_interval=1))
    det = GradientDetector(model.named_parameters(), config, reporter=Reporter([flag]), **kwargs)  # type: ignore[arg-type]
    return det, flag


def test_samples_every_nth_matrix_parameter() -> None:
    det, _ = _detector(_model(), config=SDCConfig(grad_sample_interval=2))
    assert [n for n, _ in det.sampled] == ["0.weight", "4.weight"]


def test_checks_once_per_accumulation_window_never_between_microbatches() -> None:
    model = _model()
    det, flag = _detector(model, accumulation_steps=4)
    for step in range(15):
        for micro in range(4):
            _backward(model)
            if step == 14 and micro == 1:  # corrupt mid-window: nothing may fire before its end
                flip_bit(model[2].weight.grad, 7, 30)
            result = det.after_backward()
            assert (result is None) == (micro < 3)
            if micro < 3:
                assert not flag.vetoed
        if step < 14:
            model.zero_grad()
    assert det.steps == 15
    events = flag.take()
    assert [e.kind for e in events] == ["gradient"] and events[0].where == "2.weight"
    assert events[0].detail["detector_step"] == 15


def test_warmup_then_jump_threshold_nan_and_no_false_alarm() -> None:
    model = _model()
    det, flag = _detector(model)
    grads = {}
    for _ in range(12):  # warm-up with a bigger value at step 1 cannot trigger
        _backward(model)
        det.after_backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
    assert not flag.vetoed
    for name, p in model.named_parameters():
        p.grad = grads[name]
    p0 = model[0].weight
    p0.grad.mul_(100.0)  # 10^4 x in the squared statistic: below the 10^6 jump threshold
    det.check()
    assert not flag.vetoed
    p0.grad.mul_(1e4)  # now 10^12 x: abnormal
    det.check()
    (event,) = flag.take()
    assert event.where == "0.weight" and event.magnitude > 1 and not event.confirmed
    p0.grad[0, 0] = float("nan")
    det.check()
    assert [e.where for e in flag.take()] == ["0.weight"]


def test_strike_policy_cooldown_and_window() -> None:
    clock = Clock()
    policy = StrikePolicy(cooldown_s=60, strikes_num=3, window_s=600, clock=clock)
    assert not policy.anomaly()
    clock.now = 30
    assert not policy.anomaly()  # within the cooldown: not counted
    clock.now = 100
    assert not policy.anomaly()
    clock.now = 900  # the first two fell out of the window
    assert not policy.anomaly()
    clock.now = 1000
    assert not policy.anomaly()
    clock.now = 1100
    assert policy.anomaly()  # 900, 1000 and 1100 within 600 s: strike
    clock.now = 1200
    assert not policy.anomaly()  # count restarts after a strike


def test_strikes_escalate_checksums_for_the_cooldown() -> None:
    clock = Clock()
    switch = ChecksumSwitch(on=False, clock=clock)
    model = _model()
    config = SDCConfig(grad_sample_interval=1, strikes_num=2, cooldown=1, checksum_cooldown=10)
    det, flag = _detector(model, config=config, switch=switch, clock=clock)
    for _ in range(12):
        _backward(model)
        det.after_backward()
    p = model[0].weight
    for minute in (1, 2):
        clock.now = 60.0 * minute
        p.grad.mul_(1e6)
        det.check()
    kinds = [e.kind for e in flag.take()]
    assert kinds == ["gradient", "gradient", "gradient_strikes"]
    assert det.escalations == 1 and switch.is_on()
    clock.now += 59
    assert switch.is_on()
    clock.now += 2
    assert not switch.is_on()  # cooldown (1 min) over


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_gradients_use_the_local_shard(world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.ones(8, 4) * 3.0, mesh, [Shard(0)])
    det, flag = _detector(nn.ParameterDict({"w": weight}))
    det.check()
    assert det._history["w"].pre_val == 9.0  # (max |g|)^2 of the local shard
    weight.grad = distribute_tensor(torch.full((8, 4), float("inf")), mesh, [Shard(0)])
    det.check()  # also runs the escalation all-reduce over the default group
    assert [e.where for e in flag.take()] == ["w"]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="accumulation_steps"):
        GradientDetector([], accumulation_steps=0)


def test_a_strike_on_one_rank_turns_checksums_on_everywhere() -> None:
    from .threaded import run_ranks

    def body(group: dist.ProcessGroup, rank: int) -> list[bool]:
        torch.manual_seed(0)
        clock = Clock()
        switch = ChecksumSwitch(on=False, clock=clock)
        model = _model()
        config = SDCConfig(grad_sample_interval=1, strikes_num=1)
        det, _ = _detector(
            model, config=config, switch=switch, clock=clock, group=group, sync_every=4
        )
        states = []
        for step in range(1, 17):
            _backward(model)
            if rank == 0 and step == 13:
                model[0].weight.grad.mul_(1e8)
            det.after_backward()
            model.zero_grad()
            states.append(switch.is_on())
        return states

    for states in run_ranks(2, body):
        assert states == [False] * 15 + [True]  # the strike at step 13 is shared at step 16
