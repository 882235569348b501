"""Eager mode: check every covered matmul (forward and backward) run inside a dispatch mode.

``torch.matmul``, ``F.linear`` and ``nn.Linear`` reach the dispatcher as ``mm``, ``addmm`` or
``bmm``; MoE experts as ``_grouped_mm``. The autograd engine carries the mode into the backward
pass, so gradient matmuls are checked too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from .checksum import SIGMAS
from .events import Reporter, default_reporter
from .sites import COVERED_OPS, CheckStats, check_and_report, current_phase, operands
from .switch import ChecksumSwitch, checksum_switch

__all__ = ["DEFAULT_DTYPES", "ChecksumMode"]

DEFAULT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ChecksumMode(TorchDispatchMode):
    """Check covered matmuls of the given output dtypes while ``switch`` says so.

    ``switch`` (default: the process-wide one) applies run-time on/off, escalation windows and
    sampling (``switch.sample_every``). Confirmed faults go to ``reporter`` (default: the
    process-wide one, which logs and raises); ``stats`` counts what was checked and found. With
    ``track_modules`` an event names the innermost module that ran the matmul (this adds global
    module hooks, so it costs a little more).
    """

    def __init__(
        self,
        *,
        reporter: Reporter | None = None,
        switch: ChecksumSwitch | None = None,
        dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
        sigmas: float = SIGMAS,
        track_modules: bool = False,
    ) -> None:
        super().__init__()
        self.track_modules = track_modules
        self._tracker: ModuleTracker | None = None
        self.reporter = reporter
        self.switch = switch or checksum_switch
        self.dtypes = frozenset(dtypes)
        self.sigmas = sigmas
        self.stats = CheckStats()
        self._calls = 0

    def __enter__(self) -> ChecksumMode:
        if self.track_modules:
            self._tracker = ModuleTracker()
            self._tracker.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._tracker is not None:
                self._tracker.__exit__(*exc)
                self._tracker = None

    def _module(self) -> str:
        if self._tracker is None:
            return ""
        return max(self._tracker.parents - {"Global"}, key=len, default="") + ":"

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = COVERED_OPS.get(func)
        if (
            op is None
            or not isinstance(out, Tensor)
            or out.dtype not in self.dtypes
            or not self.switch.should_check()
        ):
            return out
        self._calls += 1
        check_and_report(
            op,
            operands(op, args, kwargs),
            out,
            where=f"{self._module()}{op}:{current_phase()}#{self._calls}",
            reporter=self.reporter or default_reporter(),
            stats=self.stats,
            sigmas=self.sigmas,
        )
        return out
