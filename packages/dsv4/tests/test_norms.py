"""RMSNorm, rms_normalize and apply_rope are single autograd nodes with hand-written backwards."""

from functools import partial

import torch

from ttnpu.dsv4.norms import RMSNorm, rms_normalize
from ttnpu.dsv4.rope import RopeTable, apply_rope, rope_frequencies


def test_norm_backwards_match_numerical_gradients() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    norm = RMSNorm(8, 1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    assert torch.autograd.gradcheck(lambda t, _: norm(t), (x, norm.weight))
    assert torch.autograd.gradcheck(lambda t: rms_normalize(t, 1e-6), (x,))


def test_norm_keeps_only_its_input_and_the_rsqrt() -> None:
    x = torch.randn(16, 64, requires_grad=True)
    norm = RMSNorm(64, 1e-6)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    kept.pop(norm.weight.untyped_storage().data_ptr())
    assert sorted(kept.values()) == [16 * 4, 16 * 64 * 4]


def test_rope_backward_is_the_inverse_rotation() -> None:
    table = RopeTable.build(rope_frequencies(4, 10000.0), 3, torch.device("cpu"))
    table = RopeTable(table.cos.double(), table.sin.double(), table.inv_freq)
    for shape in ((2, 3, 6), (2, 3, 5, 6)):  # [B, S, D] and [B, S, H, D]
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        for inverse in (False, True):
            rotate = partial(apply_rope, table=table, inverse=inverse)
            assert torch.autograd.gradcheck(rotate, (x,))
