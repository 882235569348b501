from __future__ import annotations

import pytest
import torch
from torch import nn

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
