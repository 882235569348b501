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

__all__ = ["Fused"]

_DEVICES = ("cpu", "cuda")


class Fused:
    """``fn`` compiled by Inductor where it generates code for the first tensor's device (CPU,
    CUDA) and the tensor is a plain one, as it is elsewhere (an NPU, the meta device, a tensor
    subclass such as DTensor or a fake tensor), and as it is for good once compiling failed (no
    C++ compiler on a CPU host: one warning naming ``what``). ``dynamic`` is
    :func:`torch.compile`'s: ``True`` for checks that see many shapes (one graph for every
    matmul of a model instead of one per shape); ``eager``, the same computation written for
    eager execution, where it differs (default: ``fn``)."""

    def __init__(
        self,
        fn: Callable[..., Tensor],
        what: str,
        *,
        eager: Callable[..., Tensor] | None = None,
        dynamic: bool | None = None,
    ) -> None:
        self.eager = eager or fn
        self.what = what
        self.compiled = torch.compile(fn, dynamic=dynamic)
        self.failed = False

    def __call__(self, x: Tensor, *args: Any) -> Tensor:
        if (
            self.failed
            or x.device.type not in _DEVICES
            or type(x) not in (Tensor, torch.nn.Parameter)
        ):
            return self.eager(x, *args)
        try:
            return self.compiled(x, *args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.failed = True
            warnings.warn(
                f"ttnpu-sdc: {self.what} run eagerly, compiling them failed: "
                f"{error.inner_exception}",
                stacklevel=2,
            )
            return self.eager(x, *args)
