"""Capture leaves no trace; replay forces the cached choice and recomputes weights and gradients."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from ttnpu.routing import Router, RouteReplayError, RouterSet, find_routers
from ttnpu.routing.testing import MarkovCorpus, TinyMoE, TopKRouter


def model_and_batch(seed: int = 0) -> tuple[TinyMoE, torch.Tensor]:
    torch.manual_seed(seed)
    return TinyMoE(layers=3), MarkovCorpus(batch=4, seed=seed).batch_at(0)


def test_routers_are_found_by_module_name() -> None:
    model, _ = model_and_batch()
    assert list(find_routers(model)) == [f"blocks.{i}.moe.router" for i in range(3)]
    assert isinstance(model.blocks[0].moe.router, Router)
    with pytest.raises(ValueError, match=r"no submodule implementing ttnpu.routing.Router"):
        RouterSet(nn.Linear(2, 2))


def test_reference_router_rejects_bad_forced_indices() -> None:
    router = TopKRouter(dim=4, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="int64"):
        router.force_indices(torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[num_tokens, 2\]"):
        router.force_indices(torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"outside 0..7"):
        router.force_indices(torch.full((3, 2), 8))
    router.force_indices(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="for 3 tokens, the input has 5"):
        router(torch.randn(5, 4))


def test_capture_equals_live_routing_and_leaves_no_trace() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    model(batch)  # some earlier forward: last_indices and load buffers are set
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    last = {n: routers.router(n).last_indices for n in routers.names}
    rng, py_rng = torch.get_rng_state(), random.getstate()

    captured = routers.capture(lambda: model(batch))

    assert all(torch.equal(buffers[n], b) for n, b in model.named_buffers())
    assert all(routers.router(n).last_indices is last[n] for n in routers.names)
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng
    assert all(not t.requires_grad for t in captured.values())
    model(batch)  # live, with the same dropout masks the capture saw
    for name in routers.names:
        assert torch.equal(captured[name], routers.router(name).last_indices)


def test_capture_stops_after_the_last_router() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    calls = []
    model.head.register_forward_hook(lambda *_: calls.append(1))
    routers.capture(lambda: model(batch))
    assert calls == []
    routers.capture(lambda: model(batch), stop_after_last_router=False)
    assert calls == [1]


def test_capture_needs_each_router_exactly_once() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    with pytest.raises(RuntimeError, match="ran twice"):
        routers.capture(lambda: (model(batch), model(batch)), stop_after_last_router=False)
    with pytest.raises(RouteReplayError, match=r"did not run in the capture forward"):
        routers.capture(lambda: model.embed(batch))


def test_replay_recomputes_weights_and_gradients_from_current_parameters() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    stale = routers.capture(lambda: model.loss(batch))
    old = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for i in range(1, 4):  # move the parameters on
        model.loss(MarkovCorpus(batch=4).batch_at(i)).backward()
        optimizer.step()
        optimizer.zero_grad()
    live = routers.capture(lambda: model.loss(batch))
    assert any(not torch.equal(stale[n], live[n]) for n in routers.names)  # routing did move

    torch.manual_seed(1)
    with routers.replay(stale):
        loss = model.loss(batch)
        loss.backward()
    # The same forced indices applied by hand to a copy at the current parameters...
    current = copy.deepcopy(model)
    current.zero_grad()
    twin = RouterSet(current)
    for name in twin.names:
        twin.router(name).force_indices(stale[name])
    torch.manual_seed(1)
    expected = current.loss(batch)
    expected.backward()
    # ...and at the parameters that chose them.
    for name in RouterSet(old).names:
        RouterSet(old).router(name).force_indices(stale[name])
    torch.manual_seed(1)
    old.loss(batch).backward()

    assert torch.equal(loss, expected)
    for (name, p), q, r in zip(
        model.named_parameters(), current.parameters(), old.parameters(), strict=True
    ):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
        if name.endswith("gate.weight"):
            assert p.grad.abs().sum() > 0
            assert not torch.equal(p.grad, r.grad), name


def test_replay_is_cleared_after_the_block() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    routes = routers.capture(lambda: model(batch))
    with routers.replay(routes):
        model(batch)
    with torch.no_grad():
        for block in model.blocks:
            block.moe.router.bias += torch.linspace(-5, 5, 8)  # live choice now differs
    model(batch)
    assert any(not torch.equal(routes[n], routers.router(n).last_indices) for n in routers.names)


class IgnoresForcing(TopKRouter):
    """A broken router: accepts forced indices, routes live anyway."""

    def force_indices(self, indices: torch.Tensor | None) -> None:
        super().force_indices(indices)
        self._forced = None


def test_replay_never_falls_back_to_live_routing_silently() -> None:
    model, batch = model_and_batch()
    routers = RouterSet(model)
    routes = routers.capture(lambda: model(batch))
    partial = {k: v for k, v in routes.items() if k != "blocks.2.moe.router"}
    with (
        pytest.raises(RouteReplayError, match="do not match the model's routers"),
        routers.replay(partial),
    ):
        pass
    with (
        pytest.raises(
            RouteReplayError,
            match=r"routers \['blocks.1.moe.router', 'blocks.2.moe.router'\] did not run",
        ),
        routers.replay(routes),
    ):
        model.blocks[0](model.embed(batch))
    broken = IgnoresForcing(32, 8, 2)
    broken.load_state_dict(model.blocks[1].moe.router.state_dict())
    with torch.no_grad():
        broken.bias += torch.linspace(-5, 5, 8)
    model.blocks[1].moe.router = broken
    routers = RouterSet(model)
    with (
        pytest.raises(
            RouteReplayError, match=r"routers \['blocks.1.moe.router'\] did not use the replayed"
        ),
        routers.replay(routes),
    ):
        model(batch)
