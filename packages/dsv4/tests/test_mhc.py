import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttnpu.dsv4.mhc import hc_head, hc_post, hc_pre, sinkhorn


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 1.0))
def test_every_sinkhorn_output_is_doubly_stochastic(seed: int, spread: float) -> None:
    """20 iterations (t_max) converge to 1e-4 for logits in [-1, 1] (mHC logits start near 0)."""
    logits = (torch.rand(256, 4, 4, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * spread
    comb = sinkhorn(logits, iters=20, eps=1e-6)
    assert (comb >= 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(256, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(256, 4), atol=1e-4, rtol=0)


def test_sinkhorn_columns_are_exact_and_rows_keep_converging_for_large_logits() -> None:
    logits = torch.randn(256, 4, 4) * 4
    assert ((sinkhorn(logits, 20, 1e-6).sum(-2) - 1).abs() < 1e-5).all()  # ends on columns
    row_error = [(sinkhorn(logits, n, 1e-6).sum(-1) - 1).abs().max() for n in (5, 20, 200)]
    assert row_error[0] > row_error[1] > row_error[2]


def _site(n: int = 4, d: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mix = (2 + n) * n
    return torch.randn(mix, n * d), torch.randn(mix), torch.rand(3) * 2


def test_pre_and_post_bounds_and_equal_streams_keep_the_residual() -> None:
    fn, base, scale = _site()
    x = torch.randn(2, 5, 1, 8).expand(2, 5, 4, 8)
    u, post, comb = hc_pre(x, fn, base, scale, iters=20, eps=1e-6, norm_eps=1e-6)
    pre = u / x[..., 0, :]  # equal streams: u = (sum_i pre_i) x
    assert ((pre > 4e-6) & (pre < 4 * (1 + 1e-6))).all()
    assert ((post > 0) & (post < 2)).all()
    # Column sums are 1, so mixing equal streams returns x in every stream.
    residual = hc_post(torch.zeros(2, 5, 8), x, post, comb)
    torch.testing.assert_close(residual, x, atol=1e-4, rtol=1e-4)


def test_residual_uses_comb_transposed() -> None:
    x = torch.randn(1, 1, 4, 3)
    comb = torch.rand(1, 1, 4, 4)
    out = hc_post(torch.zeros(1, 1, 3), x, torch.zeros(1, 1, 4), comb)
    expected = torch.einsum("ij,id->jd", comb[0, 0], x[0, 0])  # X'_j = sum_i comb[i, j] X_i
    torch.testing.assert_close(out[0, 0], expected)


def test_sinkhorn_backward_matches_autograd_through_the_iterations() -> None:
    logits = torch.randn(3, 5, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: sinkhorn(z, 20, 1e-6), (logits,))

    def unrolled(z: torch.Tensor) -> torch.Tensor:
        comb = torch.softmax(z, dim=-1) + 1e-6
        comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
        for _ in range(19):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + 1e-6)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
        return comb

    weights = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    ours = torch.autograd.grad((sinkhorn(logits, 20, 1e-6) * weights).sum(), logits)[0]
    reference = torch.autograd.grad((unrolled(logits) * weights).sum(), logits)[0]
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(sinkhorn(logits, 20, 1e-6), unrolled(logits))


def test_site_backwards_match_numerical_gradients() -> None:
    """hc_pre, hc_head and hc_post are single autograd nodes with hand-written backwards."""
    n, d, f64 = 4, 6, torch.float64
    x = torch.randn(2, 3, n, d, dtype=f64, requires_grad=True)
    fn, base, scale = (t.to(f64).requires_grad_() for t in _site(n, d))
    with torch.no_grad():
        fn *= 0.3

    def pre(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_pre(*args, iters=5, eps=1e-6, norm_eps=1e-6)

    assert torch.autograd.gradcheck(pre, (x, fn, base, scale))
    # The first block's streams are the embedding expanded n times (stride 0).
    single = torch.randn(2, 3, 1, d, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda s, *p: pre(s.expand(2, 3, n, d), *p), (single, fn, base, scale)
    )
    # With the sub-layer's norm fused (u normalised, its weight learned).
    weight = torch.randn(d, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: hc_pre(*a[:4], iters=5, eps=1e-6, norm_eps=1e-6, norm_weight=a[4]),
        (x, fn, base, scale, weight),
    )
    head = [torch.randn(n, n * d, dtype=f64), torch.randn(n, dtype=f64), torch.rand(1, dtype=f64)]
    head = [t.requires_grad_() for t in head]
    assert torch.autograd.gradcheck(lambda *a: hc_head(*a, eps=1e-6, norm_eps=1e-6), (x, *head))
    assert torch.autograd.gradcheck(
        lambda *a: hc_head(*a[:4], eps=1e-6, norm_eps=1e-6, norm_weight=a[4]),
        (x, *head, weight),
    )
    f = torch.randn(2, 3, d, dtype=f64, requires_grad=True)
    post = torch.rand(2, 3, n, dtype=f64, requires_grad=True)
    comb = torch.rand(2, 3, n, n, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(hc_post, (f, x, post, comb))


def test_sites_keep_only_their_inputs_and_small_per_token_state() -> None:
    """What a site keeps for the backward: the streams themselves (shared with hc_post), no fp32
    copy of them and no Sinkhorn step outputs (they are recomputed from the denominators)."""
    n, d, tokens, iters = 4, 64, 32, 20
    x = torch.randn(1, tokens, n, d, requires_grad=True)
    fn, base, scale = (t.requires_grad_() for t in _site(n, d))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        u, post, comb = hc_pre(x, fn, base, scale, iters=iters, eps=1e-6, norm_eps=1e-6)
        hc_post(u, x, post, comb)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    params = {p.untyped_storage().data_ptr() for p in (fn, base, scale)}
    per_token = sum(b for ptr, b in storages.items() if ptr not in params) / tokens
    # The streams, u (hc_post's f), then fp32 per token: the mixes, gates, pre, post, Sinkhorn
    # softmax and comb (73 for n = 4, whatever the iterations), the rsqrt. Autograd through the
    # plain ops kept 2 iters x (n x n + n) more: every Sinkhorn step's output and denominator.
    assert per_token <= 4 * n * d + 4 * d + 4 * 80
