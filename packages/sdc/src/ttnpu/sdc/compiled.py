"""Compiled mode: an Inductor post-grad pass that puts a checksum op after every covered matmul.

The pass runs on every graph Inductor compiles (forward and backward of the training graph) and
inserts ``ttnpu_sdc::check_matmul(out, a, b, bias, offs, op, site, alpha, beta)`` right after each
``mm``/``addmm``/``bmm``/``_grouped_mm`` whose output dtype is selected. The op is opaque to the
compiler (a fallback kernel declared as mutating ``out``, so it is neither dropped nor reordered
past the consumers of ``out``) and asks :data:`~ttnpu.sdc.checksum_switch` at every call whether to
work: switching checks on or off never recompiles. Nothing here is device-specific: the same op
and pass run wherever Inductor does (CPU, CUDA, NPU through torch_npu's Inductor backend).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass

from .events import default_reporter
from .inject import compiled_fault
from .sites import COVERED_OPS, CheckStats, Operands, check_and_report, operands
from .switch import checksum_switch

__all__ = [
    "ChecksumGraphPass",
    "checksum_compile_options",
    "compiled_stats",
    "install_checksum_pass",
    "uninstall_checksum_pass",
]

_stats = CheckStats()


def compiled_stats() -> CheckStats:
    """Counters of the checks run by compiled graphs in this process."""
    return _stats


@torch.library.custom_op("ttnpu_sdc::check_matmul", mutates_args=("out",))
def _check_matmul_op(
    out: Tensor,
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    offs: Tensor | None,
    op: str,
    site: str,
    alpha: float,
    beta: float,
) -> None:
    phase = site.split(":", 1)[0]
    compiled_fault(op, phase, out)
    if checksum_switch.should_check():
        check_and_report(
            op,
            Operands(a, b, bias=bias, offs=offs, alpha=alpha, beta=beta),
            out,
            where=f"{op}:{site}",
            reporter=default_reporter(),
            stats=_stats,
        )


@_check_matmul_op.register_fake
def _(
    out: Tensor,
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    offs: Tensor | None,
    op: str,
    site: str,
    alpha: float,
    beta: float,
) -> None:
    return None


CHECK_OP = torch.ops.ttnpu_sdc.check_matmul.default


class ChecksumGraphPass(CustomGraphPass):
    """Post-grad pass inserting :data:`CHECK_OP` after covered matmuls of the selected dtypes."""

    def __init__(self, dtypes: Iterable[torch.dtype] = (torch.bfloat16,)) -> None:
        self.dtypes = frozenset(dtypes)
        self.graphs = 0
        self.inserted = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        backward = any(
            n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes
        )
        phase = "backward" if backward else "forward"
        for node in list(graph.nodes):
            op = COVERED_OPS.get(node.target) if node.op == "call_function" else None
            val = node.meta.get("val")
            if op is None or not isinstance(val, Tensor) or val.dtype not in self.dtypes:
                continue
            o = operands(op, node.args, node.kwargs)
            with graph.inserting_after(node):
                check = graph.call_function(
                    CHECK_OP,
                    (node, o.a, o.b, o.bias, o.offs, op, f"{phase}:{node.name}", o.alpha, o.beta),
                )
            check.meta["val"] = None
            self.inserted += 1

    def uuid(self) -> Any:
        """Changes with this file and the dtypes, so Inductor's FX cache never mixes graphs."""
        source = Path(__file__).read_bytes()
        dtypes = ",".join(sorted(str(d) for d in self.dtypes)).encode()
        return hashlib.sha256(source + dtypes).hexdigest()


class _Chain(CustomGraphPass):
    """Run a pass that was installed before ours, then ours."""

    def __init__(self, first: Any, second: ChecksumGraphPass) -> None:
        self.first, self.second = first, second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        return (first, self.second.uuid())


_previous: Any = None


def install_checksum_pass(
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
) -> ChecksumGraphPass:
    """Add the checksum pass to ``torch._inductor.config.post_grad_custom_post_pass``.

    Call before the first compiled call (compilation is lazy). A pass installed earlier by someone
    else keeps running first. Installing again replaces our pass (with the new dtypes).
    """
    global _previous
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, (ChecksumGraphPass, _Chain)):
        uninstall_checksum_pass()
        current = inductor_config.post_grad_custom_post_pass
    ours = ChecksumGraphPass(dtypes)
    _previous = current
    inductor_config.post_grad_custom_post_pass = ours if current is None else _Chain(current, ours)
    return ours


def checksum_compile_options(
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
) -> dict[str, Any]:
    """Inductor options that instrument one ``torch.compile`` call only.

    ``torch.compile(model, options=checksum_compile_options())`` checks that model while other
    compiled code in the process stays as it is (Dynamo keeps separate cache entries per backend,
    so an uninstrumented compilation of the same code is never reused for it, nor the reverse).
    """
    return {"post_grad_custom_post_pass": ChecksumGraphPass(dtypes)}


def uninstall_checksum_pass() -> None:
    """Restore the post-grad pass that was there before :func:`install_checksum_pass`."""
    global _previous
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, (ChecksumGraphPass, _Chain)):
        inductor_config.post_grad_custom_post_pass = _previous
    _previous = None
