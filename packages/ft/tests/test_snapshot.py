from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ttnpu.ft import ReplicaState, RestoreError


class Position:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]


def trained(make_model: Any, seed: int, steps: int) -> ReplicaState:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return ReplicaState(model, opt, sched, extras={"position": Position(steps)})


def frozen(state: ReplicaState) -> Any:
    return copy.deepcopy(
        (state.model.state_dict(), state.optimizer.state_dict(), state.extras["position"].value)
    )


def assert_same(a: Any, b: Any) -> None:
    fa, sa = torch.utils._pytree.tree_flatten(a)
    fb, sb = torch.utils._pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(fa, fb, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_roundtrip_into_a_fresh_replica_is_bitwise(make_model: Any) -> None:
    source = trained(make_model, seed=0, steps=3)
    target = trained(make_model, seed=1, steps=0)  # optimizer has no state yet
    target.restore(source.snapshot())
    assert_same(frozen(target), frozen(source))
    assert target.lr_scheduler.state_dict() == source.lr_scheduler.state_dict()  # type: ignore[union-attr]


def test_snapshot_is_a_cpu_copy_not_a_view(make_model: Any) -> None:
    state = trained(make_model, seed=0, steps=1)
    snap = state.snapshot()
    with torch.no_grad():
        state.model[0].weight.add_(1.0)
    assert not torch.equal(snap["model"]["0.weight"], state.model[0].weight)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda s: s["model"].__setitem__("0.weight", torch.zeros(8, 9)),
            r"model\.0\.weight: shape \(8, 9\) != live \(8, 8\)",
        ),
        (
            lambda s: s["model"].__setitem__("0.bias", s["model"]["0.bias"].double()),
            r"model\.0\.bias: dtype torch\.float64 != live torch\.float32",
        ),
        (lambda s: s["model"].pop("3.weight"), r"model: keys differ \(missing \['3\.weight'\]"),
        (
            lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(2)),
            r"optimizer\.state\[0\]\.exp_avg: shape \(2,\) != live \(8, 8\)",
        ),
        (
            lambda s: s["position"].__setitem__("value", "x"),
            r"position\.value: expected int, got str",
        ),
        (lambda s: s.pop("lr_scheduler"), r"snapshot parts"),
    ],
    ids=["shape", "dtype", "missing-key", "optimizer-shape", "extra-type", "missing-part"],
)
def test_bad_snapshot_raises_and_changes_nothing(
    make_model: Any, mutate: Any, message: str
) -> None:
    source = trained(make_model, seed=0, steps=2)
    target = trained(make_model, seed=1, steps=2)
    before = frozen(target)
    lr_before = target.lr_scheduler.state_dict()  # type: ignore[union-attr]
    snap = source.snapshot()
    mutate(snap)
    with pytest.raises(RestoreError, match=message):
        target.restore(snap)
    assert_same(frozen(target), before)
    assert target.lr_scheduler.state_dict() == lr_before  # type: ignore[union-attr]


def test_optimizer_state_must_fit_params_when_the_target_never_stepped(make_model: Any) -> None:
    source = trained(make_model, seed=0, steps=1)
    target = trained(make_model, seed=1, steps=0)
    snap = source.snapshot()
    snap["optimizer"]["state"][0]["exp_avg_sq"] = torch.zeros(8, 8, dtype=torch.float16)
    with pytest.raises(RestoreError, match=r"exp_avg_sq: dtype torch\.float16"):
        target.restore(snap)
    assert target.optimizer.state_dict()["state"] == {}


def test_reserved_extra_names_are_refused(make_model: Any) -> None:
    model = make_model(0)
    with pytest.raises(ValueError, match="extras may not be named"):
        ReplicaState(
            model, torch.optim.SGD(model.parameters(), lr=0.1), extras={"model": Position()}
        )


class NamedStateAdamW:
    """AdamW whose state dict is keyed by parameter name, as torchtitan's OptimizersContainer
    presents it (``torch.distributed.checkpoint.state_dict``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.param_groups = self.inner.param_groups

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.inner)  # type: ignore[return-value]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.inner, state_dict)  # type: ignore[arg-type]


def test_a_name_keyed_optimizer_state_roundtrips_and_is_validated(make_model: Any) -> None:
    def state(seed: int, steps: int) -> ReplicaState:
        model = make_model(seed)
        opt = NamedStateAdamW(model)
        for _ in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        return ReplicaState(model, opt)  # type: ignore[arg-type]

    source, target = state(0, 2), state(1, 1)  # both hold state for every parameter
    target.restore(source.snapshot())
    assert_same(
        (target.model.state_dict(), target.optimizer.state_dict()),
        (source.model.state_dict(), source.optimizer.state_dict()),
    )
    bad = source.snapshot()
    key = next(k for k in bad["optimizer"]["state"] if "weight" in k)
    bad["optimizer"]["state"][key]["exp_avg"] = torch.zeros(3)
    before = copy.deepcopy(target.optimizer.state_dict())
    with pytest.raises(RestoreError, match=rf"optimizer\.state\[{key}\]\.exp_avg: shape"):
        target.restore(bad)
    assert_same(target.optimizer.state_dict(), before)


class History:
    """A trainer's own state: a list of plain values that grows, and a tensor buffer."""

    def __init__(self, length: int, buffers: int = 1) -> None:
        self.seen = [[step, float(step)] for step in range(length)]
        self.buffers = [torch.zeros(2) for _ in range(buffers)]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "buffers": self.buffers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen, self.buffers = state_dict["seen"], state_dict["buffers"]


def test_an_extra_history_of_another_length_heals_but_tensors_must_fit(make_model: Any) -> None:
    def state(history: History) -> ReplicaState:
        model = make_model(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return ReplicaState(model, optimizer, extras={"train_state": history})

    live = History(3)
    state(live).restore(state(History(7)).snapshot())
    assert live.seen == [[step, float(step)] for step in range(7)]  # the peer's, whole
    with pytest.raises(RestoreError, match=r"train_state\.buffers: expected a sequence of 1"):
        state(History(3)).restore(state(History(3, buffers=2)).snapshot())


def test_held_parts_are_served_as_they_were_when_the_step_began(make_model: Any) -> None:
    """A heal served while a step runs sends the extras and the LR scheduler of the step's start
    (a counter the forward moves halfway is not sent), the model as it is; a restore, or the next
    step's call without hold, serves the live state again."""
    state = trained(make_model, seed=0, steps=2)
    assert state.lr_scheduler is not None
    state.hold_parts(True)
    at_start = state.lr_scheduler.state_dict()["last_epoch"]
    state.extras["position"].value = 99  # moved during the step
    state.lr_scheduler.step()
    with torch.no_grad():
        next(state.model.parameters()).add_(1.0)
    snap = state.snapshot()
    assert snap["position"] == {"value": 2}
    assert snap["lr_scheduler"]["last_epoch"] == at_start
    assert torch.equal(snap["model"]["0.weight"], next(state.model.parameters()).detach())
    state.hold_parts(False)
    assert state.snapshot()["position"] == {"value": 99}
    state.hold_parts(True)
    state.restore(trained(make_model, seed=1, steps=3).snapshot())
    assert state.snapshot()["position"] == {"value": 3}  # the restored state, not the held one
