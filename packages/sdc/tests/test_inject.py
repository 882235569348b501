import math

import pytest
import torch

from ttnpu.sdc import flip_bit


def test_sign_and_exponent_flips() -> None:
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert flip_bit(t, 0, 15) == -3.0 and t[0] == -1.5
    f = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    assert flip_bit(f, 1, 31) == -4.0 and f[0, 1] == -2.0
    delta = flip_bit(f, 0, 30)  # 1.0 has exponent 127: setting bit 30 makes it inf
    assert math.isinf(delta) and math.isinf(float(f[0, 0]))
    h = torch.zeros(3, dtype=torch.float16)
    assert flip_bit(h, 2, 0) == pytest.approx(2.0**-24)


def test_out_of_range_is_refused() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="bit must be in"):
        flip_bit(t, 0, 32)
    with pytest.raises(ValueError, match="index must be in"):
        flip_bit(t, 4, 0)
