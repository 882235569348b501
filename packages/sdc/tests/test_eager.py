import pytest
import torch
from torch import nn

from ttnpu.sdc import (
    BitFlip,
    ChecksumMode,
    ChecksumSwitch,
    FaultPlan,
    MatmulFaultMode,
    Reporter,
    SDCError,
    VetoFlag,
)


def _linear_step(lin: nn.Linear, x: torch.Tensor) -> None:
    lin(x).float().pow(2).sum().backward()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_flip_in_a_linear_layer_is_caught(phase: str) -> None:
    lin = nn.Linear(64, 48).bfloat16()
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    flag = VetoFlag()
    plan = FaultPlan([BitFlip(index=37, bit=14)], phase=phase)  # top exponent bit
    with MatmulFaultMode(plan), ChecksumMode(reporter=Reporter([flag]), track_modules=True) as mode:
        _linear_step(lin, x)
    assert plan.fired == 1
    events = flag.take()
    assert len(events) == 1, events
    (event,) = events
    assert event.kind == "matmul" and event.confirmed and event.detail["verdict"] == "transient"
    assert event.where.startswith(f"Linear:addmm:{phase}#" if phase == "forward" else "Linear:mm:")
    assert f":{phase}#" in event.where
    assert mode.stats.checked == 3 and mode.stats.faults == 1  # addmm forward, 2 mm backward


def test_default_reporter_raises_and_a_persistent_fault_is_named() -> None:
    lin = nn.Linear(32, 32, bias=False).bfloat16()
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    plan = FaultPlan([BitFlip(index=3, bit=14)], persistent=True)
    with (
        pytest.raises(SDCError, match="matmul") as info,
        MatmulFaultMode(plan),
        ChecksumMode(reporter=Reporter()),
    ):
        lin(x)
    assert info.value.event.detail["verdict"] == "persistent"


def test_clean_training_reports_nothing_and_sampling_and_switch_apply() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = VetoFlag()
    switch = ChecksumSwitch(sample_every=2)
    with ChecksumMode(reporter=Reporter([flag]), switch=switch) as mode:
        for _ in range(10):
            x = torch.randn(16, 32)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        switch.off()
        model(torch.randn(4, 32))
    # 2 addmm forward + 3 mm backward (no input grad for the first layer) per step, half sampled
    assert mode.stats.checked == 10 * 5 // 2
    assert not flag.vetoed and mode.stats.suspects == 0


def test_grouped_mm_experts_forward_and_backward() -> None:
    bf = torch.bfloat16
    tokens = torch.randn(48, 32, dtype=bf, requires_grad=True)
    experts = torch.randn(4, 32, 16, dtype=bf, requires_grad=True)
    offs = torch.tensor([10, 20, 40, 48], dtype=torch.int32)
    flag = VetoFlag()
    plan = FaultPlan([BitFlip(index=100, bit=14)], ops=frozenset({"_grouped_mm"}), call=2)
    with MatmulFaultMode(plan), ChecksumMode(reporter=Reporter([flag])) as mode:
        out = torch._grouped_mm(tokens, experts, offs=offs)
        out.backward(torch.randn_like(out))
    assert mode.stats.checked == 3  # forward, grad of tokens, grad of experts
    (event,) = flag.take()
    assert event.detail["op"] == "_grouped_mm" and "backward" in event.where
