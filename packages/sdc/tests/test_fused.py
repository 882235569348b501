from __future__ import annotations

import gc
import warnings
import weakref
from functools import partial
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttnpu.sdc import comm, flip_bit, sites
from ttnpu.sdc.checksum import grouped_mm_routed_dims, grouped_mm_screen, matmul_screen
from ttnpu.sdc.fused import Fused, FusedPerSignature
from ttnpu.sdc.sites import Operands

bf = torch.bfloat16


def _no_compiler(*args: object) -> torch.Tensor:
    error = RuntimeError("no working C++ compiler found")
    raise torch._dynamo.exc.BackendCompilerFailed(None, error, None)


def test_checks_run_eagerly_once_compiling_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU host without a C++ compiler: one warning naming the checks, then the same result,
    eagerly."""
    fused = Fused(comm._eager_chunk_sums, "collective checksums")
    monkeypatch.setattr(fused, "compiled", _no_compiler)
    x = torch.randn(1000)
    with pytest.warns(UserWarning, match="collective checksums run eagerly, compiling them failed"):
        first = fused(x, 127, True)
    assert fused.failed and torch.equal(first, comm._eager_chunk_sums(x, 127))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        assert torch.equal(fused(x, 127, True), first)
    assert later == []  # warned once


class _Subclass(torch.Tensor):
    """Stands for DTensor or a fake tensor: a tensor type Inductor is not handed here."""


@pytest.mark.parametrize("kind", ["meta", "subclass"])
def test_what_inductor_cannot_compile_runs_as_written(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The meta device and tensor subclasses never reach the compiler."""
    x = torch.empty(64, device="meta") if kind == "meta" else torch.ones(64).as_subclass(_Subclass)
    fused = Fused(lambda t: t * 2, "test checks")
    monkeypatch.setattr(fused, "compiled", _no_compiler)
    y = fused(x)
    assert not fused.failed and y.device == x.device
    if kind == "subclass":
        assert type(y) is _Subclass and bool((y == 2).all())


def _cases() -> dict[str, tuple[str, Operands, torch.Tensor]]:
    a, b = torch.randn(48, 64, dtype=bf), torch.randn(64, 40, dtype=bf)
    bias = torch.randn(40, dtype=bf)
    at = torch.randn(64, 48, dtype=bf).t()  # a transposed operand, as in a weight gradient
    ba, bb = torch.randn(3, 24, 32, dtype=bf), torch.randn(3, 32, 16, dtype=bf)
    ga, gb = torch.randn(64, 32, dtype=bf), torch.randn(4, 32, 16, dtype=bf)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)  # one empty group
    return {
        "mm": ("mm", Operands(a, b), a @ b),
        "mm_transposed": ("mm", Operands(at, b), at @ b),
        "addmm": (
            "addmm",
            Operands(a, b, bias=bias, beta=0.5),
            torch.addmm(bias, a, b, beta=0.5),
        ),
        "bmm": ("bmm", Operands(ba, bb), torch.bmm(ba, bb)),
        "grouped": (
            "_grouped_mm",
            Operands(ga, gb, offs=offs),
            torch._grouped_mm(ga, gb, offs=offs),
        ),
    }


def _screens(op: str) -> FusedPerSignature:
    return sites._SCREENS["_grouped_mm" if op == "_grouped_mm" else "matmul"]


def _count_compiled_calls(monkeypatch: pytest.MonkeyPatch, fused: FusedPerSignature) -> list[int]:
    calls: list[int] = []
    real = fused._run_compiled
    monkeypatch.setattr(fused, "_run_compiled", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "op_by_op"])
@pytest.mark.parametrize("case", list(_cases()))
def test_the_eager_screen_equals_the_reference_screen_and_catches_a_flip(
    monkeypatch: pytest.MonkeyPatch, case: str, compiled: bool
) -> None:
    """Compiled (past the process's first screens) or op by op (before them: never compiled)."""
    op, ops, out = _cases()[case]
    monkeypatch.setattr(sites, "SCREENS_COMPILE_AFTER", 0 if compiled else 10**9)
    fused = _screens(op)
    calls = _count_compiled_calls(monkeypatch, fused)
    if not compiled:
        monkeypatch.setattr(fused, "_compile", _no_compiler)
    value, reference = sites.eager_screen(op, ops, out), sites.screen(op, ops, out)
    torch.testing.assert_close(value, reference, rtol=1e-3, atol=1e-3)
    assert float(value) <= 1.0
    flip_bit(out, out.numel() // 2 + 3, 14)  # the top exponent bit of a bf16 element
    assert float(sites.eager_screen(op, ops, out)) > 1.0
    assert not fused.failed and len(calls) == (2 if compiled else 0)


def test_a_screen_compiles_once_per_signature_and_runs_each_as_compiled() -> None:
    """Shapes and strides are baked into a graph: each layout gets its own, the same layout
    reuses it, and a flip is caught through either graph."""
    fused = FusedPerSignature(
        partial(matmul_screen, fused=True),
        "test screens",
        eager=partial(matmul_screen, fused=False),
    )
    a, b = torch.randn(48, 64, dtype=bf), torch.randn(64, 40, dtype=bf)
    at = a.t().contiguous().t()  # the same values, column-major
    products = [(a, a @ b), (at, at @ b), (a[:24], a[:24] @ b)]
    with torch.no_grad():
        for x, out in products:
            assert float(fused(x, b, out, None, 1.0, 1.0, 6.0)) <= 1.0
        assert len(fused.graphs) == 3
        for x, out in products:
            fused(x, b, out, None, 1.0, 1.0, 6.0)
        assert len(fused.graphs) == 3
        x, out = products[1]
        flip_bit(out, 7, 14)
        assert float(fused(x, b, out, None, 1.0, 1.0, 6.0)) > 1.0


def _routed(layout: str, rows: int) -> tuple[torch.Tensor, ...]:
    """A grouped product of ``rows`` routed rows (4 experts) in one of its three layouts."""
    offs = torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows], dtype=torch.int32)
    x = torch.randn(rows, 32, dtype=bf)
    a, b = {
        "rows": (x, torch.randn(4, 32, 16, dtype=bf)),
        "k": (x.t(), torch.randn(rows, 16, dtype=bf)),
        "cols": (torch.randn(4, 24, 32, dtype=bf), x.t()),
    }[layout]
    return a, b, torch._grouped_mm(a, b, offs=offs), offs, None


@pytest.mark.parametrize("layout", ["rows", "k", "cols"])
def test_a_grouped_screen_compiles_once_whatever_rows_are_routed(layout: str) -> None:
    """Under expert parallelism the rows a rank's experts receive change every step: one graph
    over symbolic sizes screens them all as the eager form does (0 and 1 rows, which the
    compiler specialises, get their own), and catches a flip at a count it was not compiled
    for."""
    fused = FusedPerSignature(
        partial(grouped_mm_screen, fused=True),
        "test screens",
        eager=partial(grouped_mm_screen, fused=False),
        dynamic=grouped_mm_routed_dims,
    )
    with torch.no_grad():
        for rows in (64, 96, 200, 1, 0):
            args = _routed(layout, rows)
            value, eager = fused(*args, 6.0), grouped_mm_screen(*args, 6.0, False)
            torch.testing.assert_close(value, eager, rtol=1e-3, atol=1e-4)
            assert float(value) <= 1.0
            assert len(fused.graphs) == 1 + (rows <= 1) + (rows == 0), rows
        a, b, out, offs, bias = _routed(layout, 136)
        flip_bit(out, out.numel() // 2 + 3, 14)
        assert float(fused(a, b, out, offs, bias, 6.0)) > 1.0
    assert len(fused.graphs) == 3 and not fused.failed


def test_a_call_that_breaks_what_a_symbolic_graph_assumed_runs_as_written() -> None:
    """The graph compiled for 10 rows took the branch for more than 8: 4 rows share its
    signature but not that condition, and run the function as written."""
    fused = FusedPerSignature(
        lambda t: t.sum() if t.shape[0] > 8 else -t.sum(), "test checks", dynamic=lambda t: ((0,),)
    )
    with torch.no_grad():
        assert float(fused(torch.ones(10))) == 10.0 and float(fused(torch.ones(12))) == 12.0
        assert float(fused(torch.ones(4))) == -4.0
    assert len(fused.graphs) == 1


def test_past_its_signature_limit_a_screen_runs_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    fused = FusedPerSignature(lambda t: t * 2, "test checks", max_signatures=1)
    with torch.no_grad():
        fused(torch.ones(4))
        monkeypatch.setattr(fused, "_compile", _no_compiler)
        y = fused(torch.ones(5))
    assert len(fused.graphs) == 1 and not fused.failed and torch.equal(y, torch.full((5,), 2.0))


def test_a_per_signature_compiler_that_fails_warns_once_and_runs_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fused = FusedPerSignature(lambda t: t * 2, "test checks")
    monkeypatch.setattr(fused, "_compile", _no_compiler)
    with pytest.warns(UserWarning, match="test checks run eagerly, compiling them failed"):
        y = fused(torch.ones(4))
    assert fused.failed and torch.equal(y, torch.full((4,), 2.0))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        fused(torch.ones(6))
    assert later == []


def test_compile_screens_compiles_from_the_next_screen_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without it a fresh process runs its first screens op by op; after it, the next one runs
    compiled, and the count past which they compile is not lowered for what follows."""
    op, ops, out = _cases()["mm"]
    monkeypatch.setattr(sites, "_screens_run", 0)
    calls = _count_compiled_calls(monkeypatch, _screens(op))
    sites.eager_screen(op, ops, out)
    assert calls == []
    sites.compile_screens()
    value = sites.eager_screen(op, ops, out)
    assert calls == [1] and float(value) <= 1.0
    assert sites._screens_run == sites.SCREENS_COMPILE_AFTER + 1


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_mode_around_the_checked_op_sees_neither_the_compiler_nor_the_compiled_screen() -> None:
    """A fault-injection mode outside the checks (drills) must not reach the compiler's own
    tracing and benchmarking ops, nor the screen's kernels."""
    fused = FusedPerSignature(partial(matmul_screen, fused=True), "test screens")
    a, b = torch.randn(48, 64, dtype=bf), torch.randn(64, 40, dtype=bf)
    with torch.no_grad(), _Recording() as outer:
        first = fused(a, b, a @ b, None, 1.0, 1.0, 6.0)  # compiles
        fused(a, b, a @ b, None, 1.0, 1.0, 6.0)
    assert len(fused.graphs) == 1 and float(first) <= 1.0
    assert outer.ops == [torch.ops.aten.mm.default] * 2, outer.ops[:5]  # the two products only


def test_a_compiled_screen_keeps_none_of_the_tensors_it_was_compiled_for() -> None:
    """At scale a product is hundreds of MB: the graphs cached per signature must not hold the
    first call's operands alive."""
    fused = FusedPerSignature(partial(matmul_screen, fused=True), "test screens")
    a, b = torch.randn(48, 64, dtype=bf), torch.randn(64, 40, dtype=bf)
    out = a @ b
    alive = [weakref.ref(t) for t in (a, b, out)]
    with torch.no_grad():
        fused(a, b, out, None, 1.0, 1.0, 6.0)
    del a, b, out
    gc.collect()
    assert len(fused.graphs) == 1 and [ref() for ref in alive] == [None, None, None]
