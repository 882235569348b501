"""Checks compiled into one pass where Inductor can, and run as written where it cannot.

A check is a handful of reductions over tensors that the model has just produced; run eagerly,
each reduction is its own pass over memory plus an fp32 copy of a half-precision operand, and
small products pay a fixed cost of several kernel launches. Compiled, the reductions fuse into
one pass over each operand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx
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


def _signature(arg: Any) -> tuple[Any, ...]:
    """What a graph compiled for ``arg`` assumes of it: a tensor's dtype, device, shape, strides
    and 16-byte alignment (vectorised loads), any other argument's value (a graph constant)."""
    if isinstance(arg, Tensor):
        aligned = arg.data_ptr() % 16 == 0
        return (arg.dtype, arg.device, tuple(arg.shape), arg.stride(), aligned)
    return ("value", arg)


class FusedPerSignature(_Compiled):
    """``fn`` traced and compiled by Inductor once per signature of its arguments (see
    :func:`_signature`: static shapes, non-tensor arguments as constants), where Inductor can
    compile it (see :class:`_Compiled`), and the compiled code called directly: no Dynamo
    frame, guards or wrappers, and no tensors made of float arguments. For a check that runs
    tens of times a step over a few shapes, where those cost more than the check: on a CPU, a
    screen compiled this way costs 12 µs a call beyond its kernels, 37 µs through
    ``torch.compile(dynamic=True)``. Compiling costs 1-2 s per signature on a 2-core CPU
    (far less once Inductor's cache on disk holds it); past ``max_signatures`` of them, further
    signatures run ``eager`` (default: ``fn``). Call it under :func:`torch.no_grad`: a check is
    no part of the autograd graph."""

    def __init__(
        self,
        fn: Callable[..., Tensor],
        what: str,
        *,
        eager: Callable[..., Tensor] | None = None,
        max_signatures: int = 256,
    ) -> None:
        super().__init__(what, eager or fn)
        self.fn = fn
        self.max_signatures = max_signatures
        self.graphs: dict[tuple[Any, ...], Callable[..., Tensor]] = {}

    def _run_compiled(self, *args: Any) -> Tensor:
        key = tuple(_signature(a) for a in args)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_signatures:
                return self.eager(*args)
            try:
                graph = self._compile(args)
            except Exception as error:  # whatever stops the compiler must not stop the checks
                self._give_up(error)
                return self.eager(*args)
            self.graphs[key] = graph
        return graph(*(a for a in args if isinstance(a, Tensor)))

    def _compile(self, args: tuple[Any, ...]) -> Callable[..., Tensor]:
        tensors: list[Any] = [a for a in args if isinstance(a, Tensor)]

        def with_constants(*given: Tensor) -> Tensor:
            it = iter(given)
            return self.fn(*(next(it) if isinstance(a, Tensor) else a for a in args))

        with _disable_current_modes():  # a mode around the checked op sees none of the compiler
            graph = make_fx(with_constants, tracing_mode="fake")(*tensors)
            compiled: Callable[..., Tensor] = torch._inductor.compile(graph, tensors)
        return compiled
