"""Capture and replay of a model's expert choices through the :class:`Router` protocol.

Capture is a no-grad forward that leaves no trace: buffers (e.g. expert-load counters), RNG
streams and the routers' ``last_indices`` are as they were before. It stops as soon as the last
router has run (no head, no loss), and resets the FSDP2 state that the cut left mid-forward.
Replay forces cached indices on every router and checks that each router ran and used them: it
never falls back to live routing silently.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ttnpu.routing.cache import RouterSpec
from ttnpu.routing.protocol import Router, find_routers

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class RouteReplayError(RuntimeError):
    """A replayed forward did not use the cached routes (a router did not run, or chose live)."""


class _CaptureDone(Exception):
    """Raised from the last router's hook to end a capture forward early."""


class RouterSet:
    """The routers of ``model`` (every submodule implementing :class:`Router`), by module name."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._routers = find_routers(model)
        self.modules = {n: m for n, m in model.named_modules() if n in self._routers}
        if not self.modules:
            raise ValueError(
                f"{type(model).__name__} has no submodule implementing ttnpu.routing.Router "
                "(num_experts, top_k, last_indices, force_indices): nothing to capture or replay"
            )

    @property
    def names(self) -> list[str]:
        return list(self.modules)

    def router(self, name: str) -> Router:
        return self._routers[name]

    def specs(self) -> dict[str, RouterSpec]:
        return {n: RouterSpec(self.router(n).num_experts, self.router(n).top_k) for n in self.names}

    def capture(
        self, forward: Callable[[], object], *, stop_after_last_router: bool = True
    ) -> dict[str, torch.Tensor]:
        """Run ``forward()`` without grad and without side effects; return every router's indices.

        Each router must run exactly once. With ``stop_after_last_router`` the forward is cut
        short once every router has run, so layers after the last router cost nothing. Under
        FSDP2 the cut leaves the root and the last router's block unsharded and mid-forward (the
        next forward would then register no post-backward hooks for them, deferring their
        reduce-scatter to the end of the backward), so every FSDP2 root in the model gets
        ``reset_iter_state()``: call capture between optimizer steps, never between micro-batches
        of one (the reset drops gradients accumulated under ``no_sync``).
        """
        captured: dict[str, torch.Tensor] = {}

        def record(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                indices = self._routers[name].last_indices
                if name in captured:
                    raise RuntimeError(
                        f"router {name!r} ran twice in one capture forward; capture needs each "
                        "router to run exactly once"
                    )
                if indices is None:
                    raise RouteReplayError(f"router {name!r} ran but set no last_indices")
                captured[name] = indices.detach()
                if stop_after_last_router and len(captured) == len(self.modules):
                    raise _CaptureDone

            return hook

        previous = {n: self.router(n).last_indices for n in self.names}
        handles = [m.register_forward_hook(record(n)) for n, m in self.modules.items()]
        try:
            with _preserved_state(self.model), torch.no_grad():
                try:
                    forward()
                except _CaptureDone:
                    for root in _fsdp_roots(self.model):
                        root.reset_iter_state()
        finally:
            for handle in handles:
                handle.remove()
            for name, indices in previous.items():
                self.router(name).last_indices = indices
        if missing := [n for n in self.names if n not in captured]:
            raise RouteReplayError(f"routers {missing} did not run in the capture forward")
        return captured

    @contextmanager
    def replay(self, routes: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Force ``routes`` on every router for the forward (and backward) inside the block.

        On leaving the block normally, every router must have run and its ``last_indices`` must
        equal the forced ones, else :class:`RouteReplayError`.
        """
        if set(routes) != set(self.names):
            raise RouteReplayError(
                f"replay: routes for {sorted(routes)} do not match the model's routers "
                f"{sorted(self.names)}"
            )
        ran: dict[str, int] = dict.fromkeys(self.names, 0)

        def count(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                ran[name] += 1

            return hook

        handles = [m.register_forward_hook(count(n)) for n, m in self.modules.items()]
        try:
            for name in self.names:
                self.router(name).force_indices(routes[name])
            yield
        finally:
            for handle in handles:
                handle.remove()
            for name in self.names:
                self.router(name).force_indices(None)
        self._verify_replayed(routes, ran)

    def _verify_replayed(self, routes: Mapping[str, torch.Tensor], ran: dict[str, int]) -> None:
        if idle := [n for n, calls in ran.items() if calls == 0]:
            raise RouteReplayError(f"replay: routers {idle} did not run inside the replay block")
        differs: list[torch.Tensor] = []
        for name in self.names:
            used, forced = self.router(name).last_indices, routes[name]
            if used is None or used.shape != forced.shape:
                raise RouteReplayError(
                    f"replay: router {name!r} used indices of shape "
                    f"{None if used is None else list(used.shape)}, forced {list(forced.shape)}"
                )
            differs.append((used != forced).any())
        flags = torch.stack(differs).tolist()
        if live := [n for n, bad in zip(self.names, flags, strict=True) if bad]:
            raise RouteReplayError(f"replay: routers {live} did not use the replayed indices")


@contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore the model's buffers and every RNG stream (torch, device, Python, NumPy) on exit."""
    buffers = [
        (module, name, tensor, tensor.clone(), tensor._version)
        for module in model.modules()
        for name, tensor in module.named_buffers(recurse=False)
    ]
    device_types = {t.device.type for t in model.parameters()} - {"cpu"}
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(
        devices=_device_indices(model), device_type=next(iter(device_types), None)
    ):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)
            with torch.no_grad():
                for module, name, tensor, saved, version in buffers:
                    if getattr(module, name) is not tensor:
                        setattr(module, name, tensor)
                    if tensor._version != version:
                        tensor.copy_(saved)


def _fsdp_roots(model: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP2 modules in ``model``: the ones ``reset_iter_state()`` accepts."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    roots: dict[str, FSDPModule] = {}  # by the prefix of the names below them
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and not any(map(name.startswith, roots)):
            roots[f"{name}." if name else ""] = module
    return list(roots.values())


def _device_indices(model: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in model.parameters() if t.device.type != "cpu"})
