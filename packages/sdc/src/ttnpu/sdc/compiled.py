"""Compiled mode: an Inductor post-grad pass that compiles a checksum into the graph of every
covered matmul.

The pass runs on every graph Inductor compiles (forward and backward of the training graph). After
each ``mm``/``addmm``/``bmm``/``_grouped_mm`` whose output dtype is selected it inlines the
checksum screen (:func:`~ttnpu.sdc.sites.screen`: row sums and norms of the operands and the
product, the rounding bound, the worst row's ratio) as ordinary graph ops, so Inductor fuses its
reductions into its own kernels, one pass over each operand, and over the product together with
the product's other readers where their loops match. Then
``ttnpu_sdc::check_matmul(screen, out, a, b, bias, offs, op, site, alpha, beta)`` reads the
screen's verdict (one 0-d value) and only a result that does not pass goes through the full check,
recomputation and report (``verdicts="each"``). With ``verdicts="graph"`` there is one such op per
graph instead, ``ttnpu_sdc::check_graph(screens, sites, dtypes, shapes)`` after the graph's last
screen: one call and one host synchronisation per graph instead of one per product (a training
step's forward and backward graphs hold dozens of products: on an accelerator each sync drains its
queue), and a product that fails is reported unconfirmed (its operands are gone by then; re-running
the step under ``"each"`` confirms, as a trainer re-runs any vetoed step). Either op asks
:data:`~ttnpu.sdc.checksum_switch` at every call whether to read the verdicts (per product or per
graph; with ``sample_every`` a graph counts as one call): switching checks on or off never
recompiles, and while they are off the graph still pays the fused screens (``compiled_checks_off``
in ``python -m ttnpu.sdc.bench``), not the verdicts' host synchronisation. Nothing here is
device-specific: the same ops and pass run wherever Inductor does (CPU, CUDA, NPU through
torch_npu's Inductor backend).

Graphs compiled with ``fault_injection=True`` also get ``ttnpu_sdc::inject(out, op, site)`` right
after each matmul, before anything reads the product, where :func:`~ttnpu.sdc.arm_compiled_fault`
corrupts it at run time; production graphs do not carry that hook.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import torch._inductor.config as inductor_config
from torch import Tensor
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import fwd_only

from .events import default_reporter
from .inject import compiled_fault
from .sites import (
    COVERED_OPS,
    CheckStats,
    Operands,
    check_and_report,
    operands,
    report_suspect,
    screen,
)
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


# Both ops are defined on a plain Library (not ``torch.library.custom_op``, whose wrapper costs
# ~10 µs a call, once per matmul). The check's schema declares the screen mutated (it is not
# written) so that the compiler keeps the op; the hook mutates the product it corrupts.
_LIB = torch.library.Library("ttnpu_sdc", "DEF")
_LIB.define(
    "check_matmul(Tensor(a!) screened, Tensor out, Tensor a, Tensor b, Tensor? bias, "
    "Tensor? offs, str op, str site, float alpha, float beta) -> ()"
)


def _check_matmul_op(
    screened: Tensor,
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
    if checksum_switch.should_check():
        check_and_report(
            op,
            Operands(a, b, bias=bias, offs=offs, alpha=alpha, beta=beta),
            out,
            where=f"{op}:{site}",
            reporter=default_reporter(),
            stats=_stats,
            screened=screened,
        )


_LIB.impl("check_matmul", _check_matmul_op, "CompositeExplicitAutograd")


@torch.library.register_fake("ttnpu_sdc::check_matmul", lib=_LIB)
def _(*args: Any) -> None:
    return None


_LIB.define("check_graph(Tensor(a!) screens, str[] sites, str[] dtypes, str[] shapes) -> ()")


def _check_graph_op(
    screens: Tensor, sites: list[str], dtypes: list[str], shapes: list[str]
) -> None:
    """A graph's screens (1-D, one per product, in graph order) read with one host sync; each
    product that fails is reported unconfirmed."""
    if not checksum_switch.should_check():
        return
    _stats.checked += len(sites)
    reporter = default_reporter()
    for value, site, dtype, shape in zip(screens.tolist(), sites, dtypes, shapes, strict=True):
        if not value <= 1.0:  # NaN too
            op = site.split(":", 1)[0]
            report_suspect(reporter, _stats, site, value, op=op, dtype=dtype, shape=shape)


_LIB.impl("check_graph", _check_graph_op, "CompositeExplicitAutograd")


@torch.library.register_fake("ttnpu_sdc::check_graph", lib=_LIB)
def _(*args: Any) -> None:
    return None


_LIB.define("inject(Tensor(a!) out, str op, str site) -> ()")


def _inject_op(out: Tensor, op: str, site: str) -> None:
    compiled_fault(op, site.split(":", 1)[0], out)


_LIB.impl("inject", _inject_op, "CompositeExplicitAutograd")


@torch.library.register_fake("ttnpu_sdc::inject", lib=_LIB)
def _(*args: Any) -> None:
    return None


CHECK_OP = torch.ops.ttnpu_sdc.check_matmul.default
CHECK_GRAPH_OP = torch.ops.ttnpu_sdc.check_graph.default
CONVERT_OP = torch.ops.prims.convert_element_type.default
VIEW_OP = torch.ops.aten.view.default
CAT_OP = torch.ops.aten.cat.default
INJECT_OP = torch.ops.ttnpu_sdc.inject.default


def _inline_screen(graph: torch.fx.Graph, op: str, o: Operands, out: torch.fx.Node) -> Any:
    """Trace the op's screen on the nodes' fake values and copy its ops into ``graph`` at the
    current insertion point; returns the node of the screen's value."""
    names = [name for name in ("a", "b", "bias", "offs") if getattr(o, name) is not None]
    nodes = [getattr(o, name) for name in names] + [out]

    def traced(*values: Tensor) -> Tensor:
        given = dict(zip(names, values[:-1], strict=True))
        ops = Operands(
            given["a"], given["b"], given.get("bias"), given.get("offs"), o.alpha, o.beta
        )
        return screen(op, ops, values[-1], fused=True)

    values = [n.meta["val"] for n in nodes]
    fake_mode = detect_fake_mode(values)  # tensors the screen creates must be fake too
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        sub = fwd_only(traced, values)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return graph.graph_copy(sub.graph, dict(zip(placeholders, nodes, strict=True)))


Verdicts = Literal["each", "graph"]


class ChecksumGraphPass(CustomGraphPass):
    """Post-grad pass compiling a checksum after covered matmuls of the selected dtypes (and, with
    ``fault_injection``, the hook :func:`~ttnpu.sdc.arm_compiled_fault` corrupts products at).
    ``verdicts``: read each product's screen after it (``"each"``, a suspect confirmed on the
    spot) or all of a graph's screens at once after its last (``"graph"``, a suspect reported
    unconfirmed); see the module docstring."""

    def __init__(
        self,
        dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
        fault_injection: bool = False,
        verdicts: Verdicts = "each",
    ) -> None:
        if verdicts not in ("each", "graph"):
            raise ValueError(f"checksum pass: verdicts must be 'each' or 'graph', got {verdicts!r}")
        self.dtypes = frozenset(dtypes)
        self.fault_injection = fault_injection
        self.verdicts = verdicts
        self.graphs = 0
        self.inserted = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        backward = any(
            n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes
        )
        phase = "backward" if backward else "forward"
        screens: list[tuple[torch.fx.Node, str, Tensor]] = []
        for node in list(graph.nodes):
            op = COVERED_OPS.get(node.target) if node.op == "call_function" else None
            val = node.meta.get("val")
            if op is None or not isinstance(val, Tensor) or val.dtype not in self.dtypes:
                continue
            o = operands(op, node.args, node.kwargs)
            site = f"{phase}:{node.name}"
            with graph.inserting_before(node.next):  # in order, right after the matmul
                if self.fault_injection:
                    graph.call_function(INJECT_OP, (node, op, site)).meta["val"] = None
                screened = _inline_screen(graph, op, o, node)
                if self.verdicts == "each":
                    check = graph.call_function(
                        CHECK_OP,
                        (screened, node, o.a, o.b, o.bias, o.offs, op, site, o.alpha, o.beta),
                    )
                    check.meta["val"] = None
            screens.append((screened, f"{op}:{site}", val))
            self.inserted += 1
        if self.verdicts == "graph" and screens:
            self._check_graph(graph, screens)

    @staticmethod
    def _check_graph(graph: torch.fx.Graph, screens: list[tuple[Any, str, Tensor]]) -> None:
        """One ``check_graph`` after the last screen, on the screens stacked into one vector."""
        values = []
        with graph.inserting_before(screens[-1][0].next):  # in order, after the last screen
            for node, *_ in screens:
                val = node.meta["val"]
                if val.dtype != torch.float32:  # the screen of an fp64 product
                    node = graph.call_function(CONVERT_OP, (node, torch.float32))
                    node.meta["val"] = val = val.float()
                values.append(graph.call_function(VIEW_OP, (node, [1])))
                values[-1].meta["val"] = val.view(1)
            stacked = graph.call_function(CAT_OP, (values,))
            stacked.meta["val"] = torch.cat([v.meta["val"] for v in values])
            check = graph.call_function(
                CHECK_GRAPH_OP,
                (
                    stacked,
                    [where for _, where, _ in screens],
                    [str(val.dtype) for *_, val in screens],
                    ["x".join(map(str, val.shape)) for *_, val in screens],
                ),
            )
        check.meta["val"] = None

    def uuid(self) -> Any:
        """Changes with the sources of what the pass inserts and with the options, so Inductor's
        FX cache never mixes graphs."""
        sources = b"".join(
            Path(__file__).with_name(name).read_bytes()
            for name in ("compiled.py", "sites.py", "checksum.py")  # what the screen traces
        )
        dtypes = ",".join(sorted(str(d) for d in self.dtypes))
        options = f"{dtypes},{self.fault_injection},{self.verdicts}"
        return hashlib.sha256(sources + options.encode()).hexdigest()


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
    fault_injection: bool = False,
    verdicts: Verdicts = "each",
) -> ChecksumGraphPass:
    """Add the checksum pass to ``torch._inductor.config.post_grad_custom_post_pass``.

    Call before the first compiled call (compilation is lazy). A pass installed earlier by someone
    else keeps running first. Installing again replaces our pass (with the new options).
    ``fault_injection`` compiles the hooks :func:`~ttnpu.sdc.arm_compiled_fault` needs (drills,
    tests).
    """
    global _previous
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, (ChecksumGraphPass, _Chain)):
        uninstall_checksum_pass()
        current = inductor_config.post_grad_custom_post_pass
    ours = ChecksumGraphPass(dtypes, fault_injection, verdicts)
    _previous = current
    inductor_config.post_grad_custom_post_pass = ours if current is None else _Chain(current, ours)
    return ours


def checksum_compile_options(
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
    fault_injection: bool = False,
    verdicts: Verdicts = "each",
) -> dict[str, Any]:
    """Inductor options that instrument one ``torch.compile`` call only.

    ``torch.compile(model, options=checksum_compile_options())`` checks that model while other
    compiled code in the process stays as it is (Dynamo keeps separate cache entries per backend,
    so an uninstrumented compilation of the same code is never reused for it, nor the reverse).
    """
    return {"post_grad_custom_post_pass": ChecksumGraphPass(dtypes, fault_injection, verdicts)}


def uninstall_checksum_pass() -> None:
    """Restore the post-grad pass that was there before :func:`install_checksum_pass`."""
    global _previous
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, (ChecksumGraphPass, _Chain)):
        inductor_config.post_grad_custom_post_pass = _previous
    _previous = None
