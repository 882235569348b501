import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, MoE, update_expert_bias
from ttnpu.dsv4.moe import GroupedExperts, HashRouter, Router, grouped_linear


def _moe(config: DeepSeekV4Config, *, hash_routed: bool = False) -> MoE:
    moe = MoE(config, hash_routed=hash_routed)
    moe.reset_parameters(0.1)
    return moe


def test_weights_sum_to_route_scale_and_bias_changes_selection_only(tiny: DeepSeekV4Config) -> None:
    router = Router(tiny.dim, 8, 2, route_scale=1.5)
    router.reset_parameters(0.1)
    x = torch.randn(64, tiny.dim)
    weights, indices, scores = router(x, torch.zeros(8))
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 1.5))
    bias = torch.zeros(8)
    bias[indices[0, 0]] = -100.0  # push the first token's favourite out
    weights_b, indices_b, _ = router(x, bias)
    assert not torch.equal(indices_b, indices)
    # Weights still come from the unbiased scores at whatever was selected.
    expected = scores.gather(1, indices_b)
    torch.testing.assert_close(weights_b, expected / expected.sum(-1, keepdim=True) * 1.5)


def test_hash_layers_route_by_token_id_with_distinct_experts(tiny: DeepSeekV4Config) -> None:
    moe = _moe(tiny, hash_routed=True)
    assert isinstance(moe.gate, HashRouter)
    table = moe.gate.tid2eid
    assert all(len(set(row.tolist())) == row.numel() for row in table)
    ids = torch.randint(0, tiny.vocab_size, (40,))
    for hidden in (torch.randn(40, tiny.dim), torch.randn(40, tiny.dim) * 10):
        _, indices, _ = moe.gate(hidden, ids)
        assert torch.equal(indices, table[ids].long())
    again = _moe(tiny, hash_routed=True)
    assert torch.equal(again.gate.tid2eid, table)  # fixed seed, independent of the global RNG


def test_forcing_the_indices_just_chosen_reproduces_forward_and_backward_bit_for_bit(
    tiny: DeepSeekV4Config,
) -> None:
    model = DeepSeekV4(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (2, 24))
    labels = torch.roll(tokens, -1, 1)

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model.loss(tokens, labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = step()
    routers = model.routers()
    assert len(routers) == tiny.n_layers - tiny.n_hash_layers + tiny.n_mtp_layers
    chosen = [r.last_indices for r in routers]
    for router, indices in zip(routers, chosen, strict=True):
        assert indices is not None and indices.shape == (48, tiny.n_activated_experts)
        router.force_indices(indices.clone())
    forced_loss, forced_grads = step()
    assert torch.equal(forced_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, forced_grads, strict=True))
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)


def test_forced_indices_are_used_instead_of_choosing(tiny: DeepSeekV4Config) -> None:
    moe = _moe(tiny)
    assert isinstance(moe.gate, Router)
    x = torch.randn(1, 10, tiny.dim)
    ids = torch.zeros(1, 10, dtype=torch.long)
    forced = torch.tensor([[5, 6]] * 10)
    moe.gate.force_indices(forced)
    moe(x, ids)
    assert torch.equal(moe.gate.last_indices, forced)
    assert moe.tokens_per_expert.tolist() == [0, 0, 0, 0, 0, 10, 10, 0]
    moe.gate.force_indices(None)
    moe(x, ids)
    assert not torch.equal(moe.gate.last_indices, forced)


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (torch.zeros(4, 2, dtype=torch.int32), "int64"),
        (torch.zeros(4, 3, dtype=torch.long), r"shape \[tokens, 2\]"),
        (torch.full((4, 2), 8, dtype=torch.long), r"\[0, 8\)"),
    ],
)
def test_bad_forced_indices_raise_naming_the_router(
    tiny: DeepSeekV4Config, indices: torch.Tensor, match: str
) -> None:
    model = DeepSeekV4(tiny)
    router = model.routers()[0]
    with pytest.raises(ValueError, match=match) as err:
        router.force_indices(indices)
    assert "layers.2.ffn.gate" in str(err.value)
    router.force_indices(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="cover 3 tokens"):
        model(torch.zeros(1, 4, dtype=torch.long))


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_experts_run_through_grouped_mm_and_match_a_per_expert_reference() -> None:
    experts = GroupedExperts(4, 16, 8, swiglu_limit=10.0)
    experts.reset_parameters(0.5)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16, requires_grad=True)
    with _OpLog() as log:
        out = experts(x, counts)
        (out * torch.randn_like(out)).sum().backward()
    assert "aten._grouped_mm" in log.ops
    rows, ref = x.split(counts.tolist()), []
    for e, chunk in enumerate(rows):
        gate, up = chunk @ experts.w1[e].t(), chunk @ experts.w3[e].t()
        hidden = torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)
        ref.append(hidden @ experts.w2[e].t())
    torch.testing.assert_close(out, torch.cat(ref), atol=1e-5, rtol=1e-5)
    # Other dtypes take one padded batched matmul, with the same result.
    offsets = counts.cumsum(0).to(torch.int32)
    w = experts.w1.detach()
    torch.testing.assert_close(
        grouped_linear(x.detach().double(), w.double(), offsets).float(),
        grouped_linear(x.detach(), w, offsets),
        atol=1e-5,
        rtol=1e-5,
    )


def test_swiglu_clamp_is_asymmetric() -> None:
    from ttnpu.dsv4.moe import swiglu_clamped

    big = torch.tensor([50.0, -50.0])
    out = swiglu_clamped(big, torch.tensor([50.0, -50.0]), 10.0)
    torch.testing.assert_close(out[0], torch.nn.functional.silu(torch.tensor(10.0)) * 10)
    torch.testing.assert_close(out[1], torch.nn.functional.silu(torch.tensor(-50.0)) * -10)


def test_bias_update_moves_toward_balance_and_resets_counters(tiny: DeepSeekV4Config) -> None:
    model = DeepSeekV4(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (2, 16))
    model.loss(tokens, tokens)  # runs the MTP block's MoE too
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    counts = {id(m): m.tokens_per_expert.clone() for m in moes}
    assert all(c.sum() == 32 * tiny.n_activated_experts for c in counts.values())
    seen: list[torch.Tensor] = []

    def reduce(stacked: torch.Tensor) -> torch.Tensor:
        seen.append(stacked)
        return stacked * 2

    update_expert_bias(model, 0.01, reduce_counts=reduce)
    assert seen[0].shape == (len(moes) - tiny.n_hash_layers, tiny.n_routed_experts)
    for m in moes:
        c = counts[id(m)]
        assert m.tokens_per_expert.sum() == 0
        if m.hash_routed:
            assert m.expert_bias.abs().sum() == 0
        else:
            torch.testing.assert_close(m.expert_bias, 0.01 * torch.sign(c.mean() - c))
    keys = model.state_dict().keys()
    assert any(k.endswith("expert_bias") for k in keys)
    assert not any(k.endswith("tokens_per_expert") for k in keys)


@pytest.mark.parametrize("recompute", [True, False])
def test_expert_backwards_match_numerical_gradients(recompute: bool) -> None:
    """Routed experts (gather, grouped SwiGLU, weights, scatter-add) and the shared expert are
    single autograd nodes with hand-written backwards, recomputing their projections or not;
    float64 takes the per-group fallback."""
    from ttnpu.dsv4.moe import Expert, local_dispatch, swiglu_clamped

    f64 = torch.float64
    experts = GroupedExperts(4, 6, 5, swiglu_limit=1.0).double()
    experts.reset_parameters(0.5)
    experts.recompute_projections = recompute
    x = torch.randn(5, 6, dtype=f64, requires_grad=True)
    indices = torch.tensor([[0, 3], [2, 0], [3, 2], [0, 2], [3, 0]])  # expert 1 gets no row
    weights = torch.rand(5, 2, dtype=f64, requires_grad=True)
    params = tuple(experts.parameters())

    def routed(x: torch.Tensor, weights: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return local_dispatch(x, indices, weights, experts)

    assert torch.autograd.gradcheck(routed, (x, weights, *params))
    counts = torch.tensor([2, 0, 3, 2])
    rows = torch.randn(7, 6, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, *_: experts(r, counts), (rows, *params))
    shared = Expert(6, 5, swiglu_limit=1.0).double()
    shared.reset_parameters(0.5)
    shared.recompute_projections = recompute
    assert torch.autograd.gradcheck(lambda r, *_: shared(r), (x, *shared.parameters()))
    big = (torch.randn(2, 9, dtype=f64) * 2).requires_grad_()  # both sides of both clamps
    assert torch.autograd.gradcheck(lambda g, u: swiglu_clamped(g, u, 1.0), tuple(big))


def test_routed_experts_keep_only_the_row_order_and_weights_for_the_backward() -> None:
    """Per routed row the dispatch keeps its token, sort position and weight: the gathered rows
    and their projections are recomputed in the backward, activations and outputs never kept."""
    from ttnpu.dsv4.moe import local_dispatch

    tokens, dim, inter, top_k = 64, 32, 16, 2
    experts = GroupedExperts(4, dim, inter, swiglu_limit=10.0)
    experts.reset_parameters(0.1)
    x = torch.randn(tokens, dim, requires_grad=True)
    indices = torch.randint(0, 4, (tokens, top_k))
    weights = torch.rand(tokens, top_k, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        local_dispatch(x, indices, weights, experts)
    skip = {t.untyped_storage().data_ptr() for t in (x, *experts.parameters())}
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    per_row = sum(b for ptr, b in kept.items() if ptr not in skip) / (tokens * top_k)
    # token and sort position (int64), weight (fp32), the offsets; autograd through the plain
    # ops kept ~3 dim + 6 inter floats per row
    assert per_row <= 8 + 8 + 4 + 1
    experts.recompute_projections = False  # then the two projections too
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        local_dispatch(x, indices, weights, experts)
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    per_row = sum(b for ptr, b in kept.items() if ptr not in skip) / (tokens * top_k)
    assert 2 * 4 * inter < per_row <= 2 * 4 * inter + 8 + 8 + 4 + 1
