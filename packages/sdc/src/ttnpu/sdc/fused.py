"""Checks compiled into one pass where Inductor can, and run as written where it cannot.

A check is a handful of reductions over tensors that the model has just produced; run eagerly,
each reduction is its own pass over memory plus an fp32 copy of a half-precision operand, and
small products pay a fixed cost of several kernel launches. Compiled, the reductions fuse into
one pass over each operand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Fused", "FusedPerSignature"]

_DEVICES = ("cpu", "cuda")


class _Compiled:
    """What both ways of compiling share: which tensors reach the compiler (a plain tensor on a
    device Inductor generates code for: CPU, CUDA), and giving up for good, with one warning
    naming ``what``, once compiling failed (no C++ compiler on a CPU host). Everything else
    runs ``eager``: an NPU, the meta device, a tensor subclass such as DTensor or a fake
    tensor."""

    def __init__(self, what: str, eager: Callable[..., Tensor]) -> None:
        self.what = what
        self.eager = eager
        self.failed = False

    def __call__(self, x: Tensor, *args: Any) -> Tensor:
        if (
            self.failed
            or x.device.type not in _DEVICES
            or type(x) not in (Tensor, torch.nn.Parameter)
        ):
            return self.eager(x, *args)
        return self._run_compiled(x, *args)

    def _run_compiled(self, *args: Any) -> Tensor:
        raise NotImplementedError

    def _give_up(self, error: BaseException) -> None:
        self.failed = True
        warnings.warn(
            f"ttnpu-sdc: {self.what} run eagerly, compiling them failed: {error}", stacklevel=4
        )


class Fused(_Compiled):
    """``fn`` through :func:`torch.compile` where Inductor can compile it (see
    :class:`_Compiled`), as written elsewhere: for a check called a few times a step, whose
    inputs' shapes vary (collective buckets), where Dynamo's per-call cost does not matter."""

    def __init__(self, fn: Callable[..., Tensor], what: str) -> None:
        super().__init__(what, fn)
        self.compiled: Callable[..., Tensor] = torch.compile(fn)

    def _run_compiled(self, *args: Any) -> Tensor:
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self._give_up(error.inner_exception)
            return self.eager(*args)


Dims = Callable[..., Sequence[Sequence[int]]]
"""For a call's arguments, the dims of each whose size varies from call to call."""


def _signature(arg: Any, dynamic: Sequence[int] = ()) -> tuple[Any, ...]:
    """What a graph compiled for ``arg`` assumes of it: a tensor's dtype, device, shape (of a
    ``dynamic`` dim only whether its size is 0, 1 or more: the compiler specialises 0 and 1),
    strides (with ``dynamic`` dims, only that it is contiguous where it is: those strides
    follow the sizes) and 16-byte alignment (vectorised loads), any other argument's value (a
    graph constant)."""
    if isinstance(arg, Tensor):
        aligned = arg.data_ptr() % 16 == 0
        shape = tuple(min(n, 2) if d in dynamic else n for d, n in enumerate(arg.shape))
        strides = "contiguous" if dynamic and arg.is_contiguous() else arg.stride()
        return (arg.dtype, arg.device, shape, strides, aligned)
    return ("value", arg)


class FusedPerSignature(_Compiled):
    """``fn`` traced and compiled by Inductor once per signature of its arguments (see
    :func:`_signature`: static shapes except the dims ``dynamic(*args)`` names, non-tensor
    arguments as constants), where Inductor can compile it (see :class:`_Compiled`), and the
    compiled code called directly: no Dynamo frame, guards or wrappers, and no tensors made of
    float arguments. For a check that runs tens of times a step over a few shapes, where those
    cost more than the check: on a CPU, a screen compiled this way costs 12 µs a call beyond its
    kernels, 37 µs through ``torch.compile(dynamic=True)``. Compiling costs 1-2 s per signature
    on a 2-core CPU (far less once Inductor's cache on disk holds it); past ``max_signatures``
    of them, further signatures run ``eager`` (default: ``fn``). A size that follows the data
    (the tokens a rank's experts receive under expert parallelism) would make a signature per
    step: ``dynamic`` names such dims, and they are compiled once over symbolic sizes, each call
    checked against the conditions the compiler assumed of them (a call that breaks one runs
    ``eager``). Call it under :func:`torch.no_grad`: a check is no part of the autograd graph."""

    def __init__(
        self,
        fn: Callable[..., Tensor],
        what: str,
        *,
        eager: Callable[..., Tensor] | None = None,
        max_signatures: int = 256,
        dynamic: Dims | None = None,
    ) -> None:
        super().__init__(what, eager or fn)
        self.fn = fn
        self.max_signatures = max_signatures
        self.dynamic = dynamic
        self.graphs: dict[tuple[Any, ...], _Graph] = {}

    def _run_compiled(self, *args: Any) -> Tensor:
        dims = self.dynamic(*args) if self.dynamic is not None else ()
        key = tuple(_signature(a, d) for a, d in zip_longest(args, dims, fillvalue=()))
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_signatures:
                return self.eager(*args)
            try:
                graph = self._compile(args, dims)
            except Exception as error:  # whatever stops the compiler must not stop the checks
                self._give_up(error)
                return self.eager(*args)
            self.graphs[key] = graph
        tensors = [a for a in args if isinstance(a, Tensor)]
        if not graph.admits(tensors):
            return self.eager(*args)
        return graph.run(*tensors)

    def _compile(self, args: tuple[Any, ...], dims: Sequence[Sequence[int]] = ()) -> _Graph:
        dynamic = [d for a, d in zip_longest(args, dims, fillvalue=()) if isinstance(a, Tensor)]
        tensors: list[Any] = [a for a in args if isinstance(a, Tensor)]

        def with_constants(*given: Tensor) -> Tensor:
            it = iter(given)
            return self.fn(*(next(it) if isinstance(a, Tensor) else a for a in args))

        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env)

        def fake(t: Tensor, varying: Sequence[int]) -> Tensor:
            sizes = [
                DimDynamic.DYNAMIC if d in varying else DimDynamic.STATIC for d in range(t.dim())
            ]
            return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(sizes))

        with _disable_current_modes():  # a mode around the checked op sees none of the compiler
            fakes: list[Any] = [fake(t, d) for t, d in zip(tensors, dynamic, strict=True)]
            with mode:
                graph = make_fx(with_constants)(*fakes)
            compiled: Callable[..., Tensor] = torch._inductor.compile(graph, fakes)
        return _Graph(compiled, shape_env, fakes)


class _Graph:
    """A compiled screen and the conditions on its symbolic sizes that tracing and compiling it
    assumed (``a.shape[0] == out.shape[0]``, ``2 <= a.shape[0]``), evaluated for every call
    whose signature it matches."""

    def __init__(self, run: Callable[..., Tensor], shape_env: ShapeEnv, fakes: list[Any]) -> None:
        self.run = run
        self.names = [f"t{i}" for i in range(len(fakes))]
        guards = shape_env.produce_guards(fakes, [LocalSource(n) for n in self.names])
        self.guards = compile(" and ".join(guards), "<screen guards>", "eval") if guards else None

    def admits(self, tensors: list[Tensor]) -> bool:
        if self.guards is None:
            return True
        given = {"L": dict(zip(self.names, tensors, strict=True))}
        return bool(eval(self.guards, SYMPY_INTERP, given))
