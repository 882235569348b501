"""The router protocol: the one place where ttnpu-routing meets a model's MoE routers.

A learned-gate router exposes the expert choice of its latest forward and accepts forced choices;
that is all anticipatory routing needs (ttnpu-dsv4's routers implement it; so can any other model).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Router(Protocol):
    """A learned-gate MoE router that can be captured and replayed.

    ``last_indices`` is the ``[num_tokens, top_k]`` int64 expert choice of the latest forward.
    ``force_indices(t)`` makes the following forwards use ``t`` instead of choosing (combination
    weights still come from the current gate at those indices, so the gate gets gradients) until
    ``force_indices(None)``; a wrong shape, dtype or range raises ``ValueError``. Capture puts
    ``last_indices`` back by assignment afterwards, so it must be a settable attribute.
    """

    num_experts: int
    top_k: int
    last_indices: torch.Tensor | None

    def force_indices(self, indices: torch.Tensor | None) -> None: ...


def find_routers(model: nn.Module) -> dict[str, Router]:
    """Every submodule of ``model`` that implements :class:`Router`, keyed by its module name."""
    found = {name: module for name, module in model.named_modules() if isinstance(module, Router)}
    for name, router in found.items():
        if router.num_experts < 1 or router.top_k < 1 or router.top_k > router.num_experts:
            raise ValueError(
                f"router {name!r}: need 1 <= top_k <= num_experts, got top_k={router.top_k}, "
                f"num_experts={router.num_experts}"
            )
    return found
