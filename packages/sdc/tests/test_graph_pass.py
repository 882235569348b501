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
from ttnpu.sdc.compiled import CHECK_OP


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


def test_checks_follow_selected_dtypes_with_their_operands() -> None:
    graph = _graph()
    ours = ChecksumGraphPass(dtypes=(torch.bfloat16,))
    ours(graph)
    checks = [n for n in graph.nodes if n.target is CHECK_OP]
    assert [c.args[5] for c in checks] == ["addmm", "_grouped_mm"]  # the fp32 mm is not selected
    addmm, grouped = checks
    assert addmm.prev is addmm.args[0] and addmm.args[7:] == (1.0, 0.5)  # alpha, beta
    assert grouped.args[4] is not None  # offs
    assert ours.inserted == 2 and ours.graphs == 1
    assert str(addmm.args[6]).startswith("forward:")
    all_dtypes = ChecksumGraphPass(dtypes=(torch.bfloat16, torch.float32))
    all_dtypes(_graph())
    assert all_dtypes.inserted == 3 and all_dtypes.uuid() != ours.uuid()


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
