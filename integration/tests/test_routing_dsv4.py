"""Contract between ttnpu-routing and ttnpu-dsv4: the routing library finds a DeepSeekV4's
learned-gate routers through its protocol alone, captures their choice without side effects, and
replays it after an optimizer step exactly as forcing the indices by hand does."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, Router
from ttnpu.routing import RouterSet, find_routers

BATCH, SEQ = 2, 24


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops on a shared machine: OpenMP threads spinning on busy cores cost 5x here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model() -> DeepSeekV4:
    torch.manual_seed(0)
    config = DeepSeekV4Config.from_flavor("micro").replace(
        n_layers=5, compress_ratios=(0, 4, 8, 4, 0), n_hash_layers=2
    )
    return DeepSeekV4(config)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.roll(tokens, -1, 1)


def _grads(model: DeepSeekV4) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_find_routers_finds_exactly_the_learned_gate_routers(model: DeepSeekV4) -> None:
    found = find_routers(model)
    c = model.config
    learned = [f"layers.{i}.ffn.gate" for i in range(c.n_hash_layers, c.n_layers)]
    assert sorted(found) == sorted([*learned, "mtp.0.ffn.gate"])
    hash_gates = [f"layers.{i}.ffn.gate" for i in range(c.n_hash_layers)]
    assert all(not isinstance(model.get_submodule(n), Router) for n in hash_gates)
    assert list(found.values()) == model.routers()
    for router in found.values():
        assert (router.num_experts, router.top_k) == (c.n_routed_experts, c.n_activated_experts)


def test_capture_leaves_buffers_rng_and_outputs_unchanged(model: DeepSeekV4) -> None:
    tokens, labels = _batch(1)
    routers = RouterSet(model)
    model.loss(tokens, labels)  # live forward: counters and last_indices are set
    live = {n: routers.router(n).last_indices for n in routers.names}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert any(n.endswith("tokens_per_expert") and b.any() for n, b in buffers.items())
    logits = model(tokens)
    buffers_after_logits = {n: b.clone() for n, b in model.named_buffers()}
    for name in routers.names:
        routers.router(name).last_indices = live[name]
    rng = torch.get_rng_state()

    routes = routers.capture(lambda: model.loss(tokens, labels))

    assert torch.equal(torch.get_rng_state(), rng)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers_after_logits[name]), name
    for name in routers.names:
        assert routers.router(name).last_indices is live[name]  # put back, not overwritten
        assert torch.equal(routes[name], live[name])  # same weights: the live choice
        assert routes[name].dtype == torch.int64
    assert torch.equal(model(tokens), logits)


def test_replay_after_a_step_trains_with_the_old_routes_and_the_current_weights(
    model: DeepSeekV4,
) -> None:
    tokens, labels = _batch(2)
    routers = RouterSet(model)
    routes = routers.capture(lambda: model.loss(tokens, labels))  # the choice at step t - 1
    stale_model = copy.deepcopy(model)
    model.loss(*_batch(3)).backward()
    with torch.no_grad():  # a plain SGD step (torch.optim would import torch._dynamo: seconds)
        for param in model.parameters():
            if param.grad is not None:
                param -= 3.0 * param.grad
    model.zero_grad(set_to_none=True)
    fresh = routers.capture(lambda: model.loss(tokens, labels))
    assert any(not torch.equal(fresh[n], routes[n]) for n in routers.names)  # routes went stale

    by_hand = copy.deepcopy(model)
    with routers.replay(routes):
        replayed = model.loss(tokens, labels)
        replayed.backward()
    for name, router in find_routers(by_hand).items():
        router.force_indices(routes[name])
    forced = by_hand.loss(tokens, labels)
    forced.backward()
    for router in find_routers(by_hand).values():
        router.force_indices(None)

    assert torch.equal(replayed, forced)
    replay_grads, forced_grads = _grads(model), _grads(by_hand)
    assert replay_grads.keys() == forced_grads.keys()
    for name, grad in replay_grads.items():
        assert torch.equal(grad, forced_grads[name]), name
    for name in routers.names:  # the gates still learn under replay
        assert replay_grads[f"{name}.weight"].any(), name
    # Current weights, not the ones the routes were captured with; old routes, not live ones.
    # The replay block cleared the forcing: a plain forward routes live again.
    with torch.no_grad():
        assert not torch.allclose(stale_model.loss(tokens, labels), replayed)
        assert not torch.allclose(model.loss(tokens, labels), replayed)
    for name in routers.names:
        assert torch.equal(routers.router(name).last_indices, fresh[name]), name
