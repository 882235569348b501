from __future__ import annotations

import pytest
import torch
from torch import nn

from ttnpu.sdc import bench_in_gemm
from ttnpu.sdc.bench import _gradient_bucket


def test_the_bench_all_reduces_one_bucket_that_every_gradient_is_a_view_of() -> None:
    """Both all-reduce variants reduce the whole gradient through one buffer, step after step."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 8), nn.Linear(8, 2)
    model = nn.Sequential(first, last)
    bucket = _gradient_bucket(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        flat = bucket()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        assert flat.abs().sum() > 0 and torch.equal(flat, grads)
        flat.mul_(2)  # what the all-reduce writes is what the optimizer reads
        assert last.bias.grad is not None and torch.equal(last.bias.grad, flat[-2:])
        opt.step()
        opt.zero_grad(set_to_none=False)
    first.weight.grad = torch.zeros_like(first.weight)
    with pytest.raises(RuntimeError, match="no longer a view of its bucket"):
        bucket()


@pytest.mark.parametrize("check", sorted(bench_in_gemm.CHECKS))
@pytest.mark.parametrize("k, n", [(64, 192), (256, 64), (64, 64)])
def test_each_compared_check_passes_a_clean_product_and_flags_a_flipped_one(
    check: str, k: int, n: int
) -> None:
    """The in-GEMM check the bench times against the screen is a working check too: its check
    column is the product's row sums, and a flipped exponent makes its bound fail."""
    torch.manual_seed(k + n)
    x = torch.randn(96, k, dtype=torch.bfloat16)
    w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    out, value = bench_in_gemm.CHECKS[check](x, w)
    torch.testing.assert_close(out, x @ w.t())
    assert float(value) <= 1.0
    assert bench_in_gemm.CHECKS[check].caught(x, w)


def test_the_in_gemm_bench_refuses_a_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_in_gemm.main(["--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
