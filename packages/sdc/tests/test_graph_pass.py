"""The pass on FX graphs traced without Inductor: fast checks of insertion and installation."""

from __future__ import annotations

from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

from ttnpu.sdc import (
    ChecksumGraphPass,
    checksum_compile_options,
    install_checksum_pass,
    uninstall_checksum_pass,
)
from ttnpu.sdc.compiled import CHECK_OP, INJECT_OP
from ttnpu.sdc.sites import COVERED_OPS


def _graph() -> torch.fx.Graph:
    def f(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, e: torch.Tensor) -> Any:
        offs = torch.tensor([4, 8], dtype=torch.int32)
        h = torch.addmm(bias, x, w, beta=0.5)
        return torch._grouped_mm(h, e, offs=offs), (x.float() @ w.float())

    bf = torch.bfloat16
    args = (
        torch.randn(8, 16, dtype=bf),
        torch.randn(16, 16, dtype=bf),
        torch.randn(16, dtype=bf),
        torch.randn(2, 16, 8, dtype=bf),
    )
    return make_fx(f, tracing_mode="fake")(*args).graph


def _reads(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from ``source``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def test_checks_follow_selected_dtypes_with_their_operands() -> None:
    graph = _graph()
    ours = ChecksumGraphPass(dtypes=(torch.bfloat16,))
    ours(graph)
    checks = [n for n in graph.nodes if n.target is CHECK_OP]
    assert [c.args[6] for c in checks] == ["addmm", "_grouped_mm"]  # the fp32 mm is not selected
    addmm, grouped = checks
    assert addmm.args[1].target is torch.ops.aten.addmm.default
    assert addmm.args[8:] == (1.0, 0.5)  # alpha, beta
    assert grouped.args[5] is not None  # offs
    # The screen is graph ops computed from the product, its operands and bias (for Inductor to
    # fuse), not an opaque call: the check op only reads its verdict.
    screened = addmm.args[0]
    assert screened.op == "call_function" and screened.target is not CHECK_OP
    for source in (addmm.args[1], *addmm.args[2:5]):
        assert _reads(screened, source)
    assert screened.meta["val"].shape == () and screened.meta["val"].dtype == torch.float32
    assert not any(n.target is INJECT_OP for n in graph.nodes)
    assert ours.inserted == 2 and ours.graphs == 1
    assert str(addmm.args[7]).startswith("forward:")
    all_dtypes = ChecksumGraphPass(dtypes=(torch.bfloat16, torch.float32))
    all_dtypes(_graph())
    assert all_dtypes.inserted == 3 and all_dtypes.uuid() != ours.uuid()


def test_fault_injection_hooks_come_right_after_each_matmul_before_its_readers() -> None:
    graph = _graph()
    ours = ChecksumGraphPass(dtypes=(torch.bfloat16,), fault_injection=True)
    ours(graph)
    hooks = [n for n in graph.nodes if n.target is INJECT_OP]
    assert [h.args[1] for h in hooks] == ["addmm", "_grouped_mm"]
    for hook in hooks:
        assert hook.prev is hook.args[0] and hook.args[0].target in COVERED_OPS
    assert ours.uuid() != ChecksumGraphPass(dtypes=(torch.bfloat16,)).uuid()


class _Other(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> Any:
        return "other"


def test_install_keeps_an_existing_pass_and_uninstall_restores_it() -> None:
    other = _Other()
    previous = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = other
    try:
        ours = install_checksum_pass()
        chained = inductor_config.post_grad_custom_post_pass
        chained(_graph())
        assert other.calls == 1 and ours.inserted == 2
        assert install_checksum_pass() is not ours  # installing again replaces ours only
        uninstall_checksum_pass()
        assert inductor_config.post_grad_custom_post_pass is other
    finally:
        inductor_config.post_grad_custom_post_pass = previous
    options = checksum_compile_options(dtypes=(torch.float16,))
    assert options["post_grad_custom_post_pass"].dtypes == {torch.float16}
