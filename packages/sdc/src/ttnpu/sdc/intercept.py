"""Hand the covered matmuls, and no other op, to Python while a window is open.

A ``TorchDispatchMode`` is called from Python for every aten op while it is entered: views,
pointwise ops and the autograd engine's bookkeeping included (12-20 µs each on a CPU, a tenth of
a small model's step, and host time an accelerator's queue waits for). Here a Python kernel is
registered once for each covered overload (``mm``, ``addmm``, ``bmm``, ``_grouped_mm``, and the
``out=`` overloads that code compiled by Inductor calls) at a
dispatch key that no tensor carries, ``PreDispatch``, whose fallback for every other op is a
fallthrough, and a window adds that key to the thread's included keys: while it is open, only the
covered ops reach Python; while none is, no op does. The key is above autograd, so the kernel sees
an op as its caller called it (forward and, through the autograd engine, which carries the
thread's dispatch keys into the backward pass, gradient products); it runs the op below the key
and hands the result to the window's handler.

``PreDispatch`` is what ``torch.export``'s pre-dispatch tracing enters; that tracing inside an open
window would clear the key when its last mode exits, after which the window sees nothing: trace
outside windows. A product goes to the innermost window its thread opened; the autograd engine
runs a device's backward on threads of its own, which opened none, so their products go to the
innermost window of the process (the key travels with the backward pass, so one is open). An op on
tensors that are not plain (a subclass such as DTensor, fake tensors while ``torch.compile``
traces, functorch wrappers) is passed on unchecked, and so are the products a subclass runs on
its local tensors (its dispatch excludes the keys above Python, this one included): a DTensor
product under tensor parallelism is not checked here (a dispatch mode's screen fails on one).
Products inside a covered op's kernel (a CPU grouped mm runs one per group) are part of it and
not checked again. Code that ``torch.compile`` made runs compiled
inside a window and its products are checked (a dispatch mode makes Dynamo run it eagerly).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .sites import COVERED_OPS

__all__ = ["Handler", "covered_ops"]

Handler = Callable[[Any, tuple[Any, ...], dict[str, Any], Tensor], None]
"""Called with (op overload, args, kwargs, result) after each covered op of a window."""

_KEY = torch._C.DispatchKey.PreDispatch
_BELOW = torch._C._dispatch_keyset_full_after(_KEY)
_OWN = torch._C.DispatchKeySet(_KEY)
_PLAIN = (Tensor, torch.nn.Parameter)
_handlers: list[tuple[int, Handler]] = []  # (thread, handler) of the open windows, in order
_lock = threading.Lock()
_library: torch.library.Library | None = None


def _kernel(op: Any) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not all(type(a) in _PLAIN for a in args if isinstance(a, Tensor)):
            # a tensor subclass (DTensor) or a fake tensor: passed on unchecked
            return op.redispatch(keyset & _BELOW, *args, **kwargs)
        # the products an op's kernel runs (a CPU grouped mm: one per group) and the check's
        # own are not checked again
        with torch._C._ExcludeDispatchKeyGuard(_OWN):
            out = op.redispatch(keyset & _BELOW, *args, **kwargs)
            handler = _handler()
            if handler is not None and type(out) in _PLAIN:  # not a fake tensor's
                handler(op, args, kwargs, out)
        return out

    return kernel


def _handler() -> Handler | None:
    """The innermost window of this thread, else of the process (an autograd engine thread)."""
    windows = _handlers
    if not windows:
        return None
    thread = threading.get_ident()
    return next((h for t, h in reversed(windows) if t == thread), windows[-1][1])


def _register() -> None:
    global _library
    with _lock:
        if _library is not None:
            return
        library = torch.library.Library("aten", "IMPL")
        for op in COVERED_OPS:
            library.impl(op, _kernel(op), "PreDispatch", with_keyset=True)
        _library = library


@contextmanager
def covered_ops(handler: Handler) -> Iterator[None]:
    """Within the window, call ``handler`` after every covered op this thread runs, and after
    the backward passes it starts; other ops never leave C++."""
    _register()
    window = (threading.get_ident(), handler)
    with _lock:
        _handlers.append(window)
    try:
        with torch._C._IncludeDispatchKeyGuard(_KEY):
            yield
    finally:
        with _lock:
            _handlers.remove(window)
