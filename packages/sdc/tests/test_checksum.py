import math
from functools import partial

import pytest
import torch

from ttnpu.sdc import (
    check_grouped_mm,
    check_matmul,
    checksum,
    flip_bit,
    screen_grouped_mm,
    screen_matmul,
    unit_roundoff,
)
from ttnpu.sdc.fused import FusedPerSignature

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _operands(
    m: int, k: int, n: int, dtype: torch.dtype, scale: float, batch: tuple[int, ...] = ()
):
    a = (torch.randn(*batch, m, k) * scale).to(dtype)
    b = (torch.randn(*batch, k, n) * scale).to(dtype)
    return a, b


def test_unit_roundoff_is_half_an_ulp_of_one() -> None:
    assert unit_roundoff(torch.bfloat16) == 2.0**-8
    assert unit_roundoff(torch.float16) == 2.0**-11
    assert unit_roundoff(torch.float32) == 2.0**-24


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_products_of_random_shapes_and_scales_are_not_suspect(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        m, k, n = (int(2 ** torch.empty(1).uniform_(0, 9, generator=g)) for _ in range(3))
        scale = 10 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
        a, b = _operands(m, k, n, dtype, scale)
        r = check_matmul(a, b, a @ b)
        assert r.ok and not r.suspect, (m, k, n, scale, r)
        assert r.error <= r.bound


def test_same_signed_wide_rows_keep_the_rounding_bias_within_the_bound() -> None:
    """K = 1 outer products (and K = 2 sums) of same-signed bf16 values: every element's
    rounding error leans the same way along a row, far beyond √N noise (these were ~20% suspect
    with a noise-only bound)."""
    g = torch.Generator().manual_seed(3)
    for k in (1, 1, 2):
        a = torch.rand(64, k, generator=g).bfloat16()
        b = torch.rand(k, 4096, generator=g).bfloat16()
        r = check_matmul(a, b, a @ b, confirm=False)
        assert not r.suspect, (k, r)
    same = torch.full((1, 4096), 1.5).bfloat16()  # one significand: the whole error is bias
    r = check_matmul(a[:, :1], same, a[:, :1] @ same)
    assert r.ok and r.verdict in ("clean", "false_alarm")  # at worst a recomputation


@pytest.mark.parametrize("dtype", DTYPES)
def test_flip_larger_than_the_row_maximum_is_caught_and_transient(dtype: torch.dtype) -> None:
    width = torch.finfo(dtype).bits
    caught = 0
    for trial in range(40):
        a, b = _operands(48, 300, 80, dtype, 10.0 ** (trial % 7 - 3))
        out = a @ b
        index, bit = (trial * 7919) % out.numel(), width - 1 - trial % 12
        row_max = float(out.view(-1, 80)[index // 80].abs().max())
        delta = flip_bit(out, index, bit)
        r = check_matmul(a, b, out)
        if not math.isfinite(row_max) or not (abs(delta) >= row_max or math.isnan(delta)):
            continue
        caught += 1
        assert not r.ok and r.verdict == "transient", (bit, delta, row_max, r)
        assert r.magnitude > 1
    assert caught >= 5


def test_batched_broadcast_and_bias() -> None:
    a, b = _operands(16, 64, 24, torch.bfloat16, 1.0, batch=(3,))
    out = torch.bmm(a, b)
    assert check_matmul(a, b, out).ok
    assert check_matmul(a, b[0], torch.matmul(a, b[0])).ok  # b broadcast over the batch
    bias = torch.randn(24, dtype=torch.bfloat16)
    a2, b2 = a[0], b[0]
    out2 = torch.addmm(bias, a2, b2, beta=0.5, alpha=2.0)
    assert check_matmul(a2, b2, out2, bias=bias, alpha=2.0, beta=0.5).ok
    assert not check_matmul(a2, b2, out2, bias=bias).ok  # wrong alpha/beta: a real mismatch
    out[1, 2, 3] += out[1, 2].abs().max() * 2
    assert check_matmul(a, b, out).verdict == "transient"


def test_persistent_fault_is_told_from_transient_by_recomputation() -> None:
    a, b = _operands(32, 64, 32, torch.bfloat16, 1.0)
    bad = a @ b
    bad[5, 5] += 100.0
    r = check_matmul(a, b, bad, recompute=lambda: bad.clone())  # the device repeats the fault
    assert (r.ok, r.verdict) == (False, "persistent")
    assert check_matmul(a, b, bad).verdict == "transient"
    assert check_matmul(a, b, bad, confirm=False).verdict == "unconfirmed"


def test_checksum_false_alarm_is_refuted_by_the_host_reference() -> None:
    a, b = _operands(32, 256, 32, torch.bfloat16, 1.0)
    r = check_matmul(a, b, a @ b, sigmas=1e-6)  # an absurdly tight bound suspects rounding
    assert r.suspect and r.ok and r.verdict == "false_alarm"


def test_nonfinite_output_from_finite_inputs_is_caught() -> None:
    a, b = _operands(8, 16, 8, torch.float32, 1.0)
    out = a @ b
    out[2, 2] = float("nan")
    assert check_matmul(a, b, out).verdict == "transient"
    a[0, 0] = float("inf")  # inputs not finite: the check cannot judge, it does not accuse
    assert check_matmul(a, b, a @ b).ok


def test_bad_shapes_and_dtypes_are_named() -> None:
    a, b = torch.randn(4, 5), torch.randn(6, 3)
    with pytest.raises(ValueError, match="last dim of a"):
        check_matmul(a, b, torch.randn(4, 3))
    with pytest.raises(ValueError, match="out is"):
        check_matmul(a, torch.randn(5, 3), torch.randn(4, 4))
    with pytest.raises(TypeError, match="b must be a floating tensor"):
        check_matmul(a, torch.ones(5, 3, dtype=torch.int64), torch.randn(4, 3))
    with pytest.raises(ValueError, match="bias"):
        check_matmul(a, torch.randn(5, 3), torch.randn(4, 3), bias=torch.randn(7))
    with pytest.raises(ValueError, match=r"^screen_matmul: a is"):
        screen_matmul(a, b, torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"^screen_grouped_mm: without offs"):
        screen_grouped_mm(a, b, torch.randn(4, 3))


def test_grouped_mm_layouts_clean_and_corrupted() -> None:
    bf = torch.bfloat16
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)  # one empty group
    cases = {
        "rows": (torch.randn(64, 32, dtype=bf), torch.randn(4, 32, 16, dtype=bf)),
        "k": (torch.randn(64, 24, dtype=bf).t(), torch.randn(64, 16, dtype=bf)),
        "cols": (
            torch.randn(4, 24, 32, dtype=bf),
            torch.randn(32, 64, dtype=bf).t().contiguous().t(),
        ),
        "batched": (torch.randn(4, 24, 32, dtype=bf), torch.randn(4, 32, 16, dtype=bf)),
    }
    for name, (a, b) in cases.items():
        o = None if name == "batched" else offs
        if name == "cols":
            b = torch.randn(64, 32, dtype=bf).t()
        out = torch._grouped_mm(a, b, offs=o)
        assert check_grouped_mm(a, b, out, offs=o).ok, name
        out.view(-1)[out.numel() // 2 + 3] += 1000.0
        r = check_grouped_mm(a, b, out, offs=o)
        assert (r.ok, r.verdict) == (False, "transient"), name


def test_grouped_weight_gradient_with_one_token_experts_checks_every_group() -> None:
    """K groups of 1 token (outer products), an empty group and tokens past the last group: the
    vectorised check is clean on a clean result and finds a flip in any group."""
    bf = torch.bfloat16
    offs = torch.tensor([1, 2, 2, 40], dtype=torch.int32)
    x = torch.rand(48, 64, dtype=bf).t()  # (dim, tokens): same-signed, as after an activation
    dy = torch.rand(48, 512, dtype=bf)
    out = torch._grouped_mm(x, dy, offs=offs)
    assert not check_grouped_mm(x, dy, out, offs=offs, confirm=False).suspect
    for group in (0, 1, 3):
        bad = out.clone()
        bad[group, 5, 7] *= 16
        r = check_grouped_mm(x, dy, bad, offs=offs)
        assert (r.ok, r.verdict) == (False, "transient"), group


@pytest.mark.parametrize("fused", [False, True])
def test_the_screen_passes_what_the_check_finds_clean_and_flags_every_caught_flip(
    fused: bool,
) -> None:
    """The screen is the full check's first stage without a host sync: <= 1 exactly where the
    check is not suspect (its two forms agree), and a flip whose fp32 norm overflows (a row the
    full check rescales) is flagged, not passed as an infinite bound."""
    g = torch.Generator().manual_seed(5)
    flagged = 0
    for trial in range(40):
        m, k, n = (int(2 ** torch.empty(1).uniform_(1, 8, generator=g)) for _ in range(3))
        a, b = _operands(m, k, n, torch.bfloat16, 10.0 ** (trial % 5 - 2))
        bias = torch.randn(n).bfloat16() if trial % 3 == 0 else None
        out = a @ b if bias is None else torch.addmm(bias, a, b)
        if trial % 2:
            flip_bit(out, (trial * 7919) % out.numel(), 14 - trial % 8)
        suspect = check_matmul(a, b, out, bias=bias, confirm=False).suspect
        ratio = float(screen_matmul(a, b, out, bias=bias, fused=fused))
        assert (not ratio <= 1.0) == suspect, (m, k, n, trial, ratio)
        flagged += suspect
    assert flagged >= 10
    a, b = _operands(16, 32, 24, torch.bfloat16, 1.0)
    out = a @ b
    out[3, 4] = 3e38  # squares overflow fp32: the norm is inf, the bound too
    assert float(screen_matmul(a, b, out, fused=fused)) == math.inf
    assert check_matmul(a, b, out).verdict == "transient"


def test_grouped_screen_flags_a_flip_in_any_group() -> None:
    bf = torch.bfloat16
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    for a, b in (
        (torch.randn(64, 32, dtype=bf), torch.randn(4, 32, 16, dtype=bf)),  # row groups
        (torch.randn(64, 24, dtype=bf).t(), torch.randn(64, 16, dtype=bf)),  # K groups
    ):
        out = torch._grouped_mm(a, b, offs=offs)
        assert float(screen_grouped_mm(a, b, out, offs=offs)) <= 1.0
        out.view(-1)[out.numel() // 2 + 3] += 1000.0
        assert float(screen_grouped_mm(a, b, out, offs=offs)) > 1.0


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "scatter"])
def test_the_grouped_screen_forms_agree_and_flag_a_flip_in_any_layout(
    monkeypatch: pytest.MonkeyPatch, masked: bool
) -> None:
    """The compiler's form (masked group sums, or a scatter) gives the
    eager form's screen for row, K and column groups, with an empty group, indices past the
    last group (NaN in the operands' padding and in the rows and columns of the product that
    ``_grouped_mm`` leaves unwritten) and a bias,
    as written and compiled, and flags a flip in the last group."""
    monkeypatch.setattr(checksum, "_masked_group_sums", lambda groups, device: masked)
    compiled = FusedPerSignature(partial(checksum.grouped_mm_screen, fused=True), "test screens")
    bf = torch.bfloat16
    offs = torch.tensor([16, 16, 40, 56], dtype=torch.int32)  # 56..64 in no group
    x, y = torch.randn(64, 32, dtype=bf), torch.randn(64, 16, dtype=bf)
    x[56:] = math.nan  # padding past the last group, in every layout's operand
    cases = {
        "rows": (x, torch.randn(4, 32, 16, dtype=bf), torch.randn(4, 16, dtype=bf)),
        "k": (x.t(), y, torch.randn(4, 16, dtype=bf)),
        "cols": (torch.randn(4, 24, 32, dtype=bf), x.t(), torch.randn(4, 64, dtype=bf)),
    }
    for name, (a, b, bias) in cases.items():
        out = torch._grouped_mm(a, b, offs=offs).float()
        for g, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True)):
            if name == "rows":
                out[s:e] += bias[g].float()
            elif name == "k":
                out[g] += bias[g].float()
            else:
                out[:, s:e] += bias[g, s:e].float()
        out = out.to(bf)
        if name == "rows":  # unwritten rows hold whatever memory held: make that a NaN
            out[56:] = math.nan
        elif name == "cols":
            out[:, 56:] = math.nan
        eager = checksum.grouped_mm_screen(a, b, out, offs, bias, checksum.SIGMAS, False)
        for form in (partial(checksum.grouped_mm_screen, fused=True), compiled):
            fused = form(a, b, out, offs, bias, checksum.SIGMAS)
            torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-6, msg=name)
            assert float(fused) <= 1.0, name
        flip_bit(out, {"rows": 55 * 16 + 3, "k": out.numel() - 5, "cols": 23 * 64 + 50}[name], 14)
        assert float(compiled(a, b, out, offs, bias, checksum.SIGMAS)) > 1.0, name
