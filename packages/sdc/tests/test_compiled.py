"""One small training graph compiled once with Inductor on CPU; every assertion reuses it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode

from ttnpu.sdc import (
    BitFlip,
    FaultPlan,
    VetoFlag,
    arm_compiled_fault,
    checksum_compile_options,
    checksum_switch,
    compiled_stats,
    disarm_compiled_fault,
    install_checksum_pass,
    uninstall_checksum_pass,
)
from ttnpu.sdc.compiled import CHECK_GRAPH_OP, CHECK_OP, ChecksumGraphPass
from ttnpu.sdc.sites import COVERED_OPS


class _Experts(nn.Module):
    """A linear, a plain matmul and MoE-style grouped experts: addmm, mm and _grouped_mm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.randn(32, 32) / 6)
        self.experts = nn.Parameter(torch.randn(4, 32, 16) / 6)
        self.register_buffer("offs", torch.tensor([8, 16, 24, 32], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x)) @ self.w
        return torch._grouped_mm(h, self.experts, offs=self.offs)


class _Inspect(CustomGraphPass):
    """Runs after our pass and records, per graph, covered nodes and whether a check follows."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sites: list[tuple[str, bool]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.inner(graph)
        for node in graph.nodes:
            val = node.meta.get("val")
            selected = isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16
            if node.op == "call_function" and node.target in COVERED_OPS and selected:
                checked = any(u.target is CHECK_OP and u.args[1] is node for u in node.users)
                self.sites.append((str(node.target), checked))

    def uuid(self) -> Any:
        return ("inspect", self.inner.uuid())


@pytest.fixture(scope="module")
def compiled() -> Iterator[tuple[Any, _Experts, Any, _Inspect]]:
    ours = install_checksum_pass(dtypes=(torch.bfloat16,), fault_injection=True)
    inspect = _Inspect(inductor_config.post_grad_custom_post_pass)
    inductor_config.post_grad_custom_post_pass = inspect
    torch.manual_seed(0)
    model = _Experts().bfloat16()
    fn = torch.compile(model, fullgraph=True)
    # The caches would hand back an already instrumented graph without running the passes.
    no_cache = inductor_config.patch(fx_graph_cache=False)
    no_aot_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    try:
        with no_cache, no_aot_cache:
            yield fn, model, ours, inspect
    finally:
        inductor_config.post_grad_custom_post_pass = ours
        uninstall_checksum_pass()
        torch._dynamo.reset()


def _step(fn: Any, x: torch.Tensor) -> torch.Tensor:
    out = fn(x)
    out.float().square().sum().backward()
    return out.detach()


def test_checks_follow_every_covered_matmul_and_toggle_without_recompiling(
    compiled: Any, veto: VetoFlag
) -> None:
    fn, _, ours, inspect = compiled
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    _step(fn, x)
    assert ours.graphs == 2  # forward and backward graphs
    ops = sorted(op for op, _ in inspect.sites)
    assert all(checked for _, checked in inspect.sites), inspect.sites
    assert "aten._grouped_mm.default" in ops and "aten.mm.default" in ops
    assert ops.count("aten._grouped_mm.default") == 3  # forward, grad input, grad experts
    assert ours.inserted == len(inspect.sites)
    checked = compiled_stats().checked
    assert checked == len(inspect.sites)

    graphs_before = counters["stats"]["unique_graphs"]
    checksum_switch.off()
    _step(fn, x)
    assert compiled_stats().checked == checked
    checksum_switch.on()
    _step(fn, x)
    assert compiled_stats().checked == 2 * checked
    assert counters["stats"]["unique_graphs"] == graphs_before and ours.graphs == 2
    assert not veto.vetoed


def test_injected_fault_inside_the_compiled_graph_is_reported(
    compiled: Any, veto: VetoFlag
) -> None:
    fn, model, ours, _ = compiled
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    clean = model(x).detach()
    plan = FaultPlan([BitFlip(index=5, bit=14)], ops=frozenset({"mm"}), phase="forward")
    arm_compiled_fault(plan)
    try:
        corrupted = _step(fn, x)
    finally:
        disarm_compiled_fault()
    assert plan.fired == 1
    (event,) = veto.take()
    assert event.kind == "matmul" and event.confirmed and event.where.startswith("mm:forward:")
    assert not torch.equal(corrupted, clean)  # the consumer saw the corrupted product
    assert ours.graphs == 2


def test_dynamic_shapes_compile_the_screen_symbolically_and_catch_a_flip(veto: VetoFlag) -> None:
    """Compiled with ``dynamic=True`` the screen is traced over symbolic sizes: batches of other
    sizes run the same graph, are checked clean, and a flip in one of them is caught."""
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).bfloat16()
    options = checksum_compile_options(fault_injection=True)
    fn = torch.compile(mlp, dynamic=True, options=options)
    before = compiled_stats().checked
    with inductor_config.patch(fx_graph_cache=False):
        for n in (8, 24):
            _step(fn, torch.randn(n, 32, dtype=torch.bfloat16))
        assert compiled_stats().checked - before == 2 * 5  # 2 forward, 3 backward products
        assert not veto.take()
        plan = FaultPlan([BitFlip(index=5, bit=14)], ops=frozenset({"addmm"}), phase="forward")
        arm_compiled_fault(plan)
        try:
            _step(fn, torch.randn(40, 32, dtype=torch.bfloat16))
        finally:
            disarm_compiled_fault()
    assert plan.fired == 1
    (event,) = veto.take()
    assert event.confirmed and event.where.startswith("addmm:forward:")
    assert options["post_grad_custom_post_pass"].graphs == 2  # one forward, one backward graph


def test_graph_verdicts_read_each_graph_once_and_report_a_flip_unconfirmed(
    veto: VetoFlag,
) -> None:
    """``verdicts="graph"``: one ``check_graph`` per graph after its last screen, no op per
    product; a clean step checks every product, switched off none, and a flip is reported as an
    unconfirmed suspect of the product it hit (an exponent bit that keeps what follows finite:
    a product of non-finite values is a suspect too, which only a re-run can clear)."""
    torch.manual_seed(2)
    model = _Experts().bfloat16()
    ours = ChecksumGraphPass(fault_injection=True, verdicts="graph")
    inspect = _Inspect(ours)
    fn = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": inspect})
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    with inductor_config.patch(fx_graph_cache=False):
        before = compiled_stats().checked
        _step(fn, x)
        assert compiled_stats().checked - before == len(inspect.sites) == ours.inserted == 8
        assert not any(checked for _, checked in inspect.sites)  # no per-product op
        assert not veto.take()
        checksum_switch.off()
        _step(fn, x)
        assert compiled_stats().checked - before == 8
        checksum_switch.on()
        plan = FaultPlan([BitFlip(index=5, bit=11)], ops=frozenset({"mm"}), phase="forward")
        arm_compiled_fault(plan)
        try:
            _step(fn, x)
        finally:
            disarm_compiled_fault()
    assert plan.fired == 1 and ours.graphs == 2
    (event,) = veto.take()
    assert event.kind == "matmul" and not event.confirmed
    assert event.where.startswith("mm:forward:") and event.magnitude > 1
    assert event.detail == {"op": "mm", "verdict": "suspect", "dtype": "torch.bfloat16",
                            "shape": "32x32"}  # fmt: skip


def test_graph_verdicts_put_one_check_after_the_graphs_last_screen() -> None:
    graph = torch.fx.symbolic_trace(lambda a, b: torch.relu(a @ b) @ b).graph
    with FakeTensorMode():  # a post-grad graph's ops and fake values
        for node in graph.nodes:
            if node.op in ("placeholder", "call_function"):
                node.meta["val"] = torch.empty(8, 8, dtype=torch.bfloat16)
            if node.op == "call_function":
                relu = node.target is torch.relu
                node.target = torch.ops.aten.relu.default if relu else torch.ops.aten.mm.default
    ChecksumGraphPass(verdicts="graph")(graph)
    graph.lint()  # every node after what it uses
    nodes = list(graph.nodes)
    (check,) = [n for n in nodes if n.target is CHECK_GRAPH_OP]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 2 and nodes.index(check) > nodes.index(mms[1])
    assert check.args[1] == ["mm:forward:matmul", "mm:forward:matmul_1"]
    assert not [n for n in nodes if n.target is CHECK_OP]


def test_unknown_verdicts_are_refused() -> None:
    with pytest.raises(ValueError, match="verdicts must be 'each' or 'graph', got 'step'"):
        checksum_compile_options(verdicts="step")  # type: ignore[arg-type]
