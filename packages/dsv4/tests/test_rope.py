import torch

from ttnpu.dsv4.rope import RopeTable, apply_rope, rope_frequencies


def test_inverse_rotation_undoes_the_rotation_and_spares_the_nope_channels() -> None:
    table = RopeTable.build(rope_frequencies(8, 10000.0), 6, torch.device("cpu"))
    x = torch.randn(2, 6, 3, 32)
    y = apply_rope(x, table)
    assert torch.equal(y[..., :24], x[..., :24])
    assert not torch.allclose(y[..., 24:], x[..., 24:])
    torch.testing.assert_close(apply_rope(y, table, inverse=True), x, atol=1e-6, rtol=1e-5)


def test_pairs_are_interleaved_channels() -> None:
    table = RopeTable.build(torch.tensor([1.0]), 2, torch.device("cpu"))
    x = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])  # position 1 rotates (1, 0) by 1 radian
    y = apply_rope(x, table)
    torch.testing.assert_close(
        y[0, 1], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))])
    )


def test_yarn_scales_only_the_low_frequencies() -> None:
    plain = rope_frequencies(64, 160000.0)
    yarn = rope_frequencies(64, 160000.0, yarn_factor=16, original_seq_len=65536)
    torch.testing.assert_close(yarn[:4], plain[:4])  # fast dims extrapolate
    torch.testing.assert_close(yarn[-4:], plain[-4:] / 16)  # slow dims interpolate
