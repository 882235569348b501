"""The route cache: captured expert choices per future step, micro-batch and router.

Indices stay on the device they were captured on, in the narrowest integer dtype that holds the
expert count, with a position-weighted checksum per entry so that a corrupted entry (a flipped bit
included) is an error at replay instead of a silently different routing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class RouteCacheError(LookupError):
    """A cache entry is missing, malformed or corrupted."""


def index_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every expert index ``0 .. num_experts - 1``."""
    if num_experts < 1:
        raise ValueError(f"index_dtype: num_experts must be >= 1, got {num_experts}")
    largest = num_experts - 1
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if largest <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def checksum(indices: torch.Tensor) -> torch.Tensor:
    """Sum of the indices weighted by odd position weights: any single changed value changes it."""
    flat = indices.reshape(-1).to(torch.int64)
    weights = torch.arange(1, 2 * flat.numel(), 2, device=flat.device, dtype=torch.int64)
    return (flat * weights).sum()


@dataclass(frozen=True)
class RouterSpec:
    """What the cache must know of a router to store and validate its indices."""

    num_experts: int
    top_k: int

    @property
    def dtype(self) -> torch.dtype:
        return index_dtype(self.num_experts)


@dataclass
class _Entry:
    indices: torch.Tensor
    checksum: torch.Tensor


class RouteCache:
    """``[step][micro-batch][router name] -> [num_tokens, top_k]`` expert indices."""

    def __init__(self, specs: Mapping[str, RouterSpec]) -> None:
        if not specs:
            raise ValueError("RouteCache: no routers to cache")
        self.specs = dict(specs)
        self._steps: dict[int, list[dict[str, _Entry]]] = {}

    @property
    def steps(self) -> list[int]:
        return sorted(self._steps)

    def __contains__(self, step: object) -> bool:
        return step in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def nbytes(self) -> int:
        return sum(
            e.indices.numel() * e.indices.element_size()
            for mbs in self._steps.values()
            for routes in mbs
            for e in routes.values()
        )

    def put(self, step: int, routes: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Store the routes of every micro-batch of ``step`` (captured as int64 or narrower)."""
        if step in self._steps:
            raise RouteCacheError(f"route cache: step {step} is already cached")
        if not routes:
            raise RouteCacheError(f"route cache: step {step} has no micro-batches")
        stored: list[dict[str, _Entry]] = []
        for mb, mb_routes in enumerate(routes):
            self._check_names(step, mb, mb_routes.keys())
            entries: dict[str, _Entry] = {}
            for name, indices in mb_routes.items():
                spec = self.specs[name]
                if indices.dim() != 2 or indices.shape[1] != spec.top_k:
                    raise RouteCacheError(
                        f"route cache: step {step} micro-batch {mb} router {name!r}: expected "
                        f"[num_tokens, {spec.top_k}] indices, got {list(indices.shape)}"
                    )
                if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                    raise RouteCacheError(
                        f"route cache: step {step} micro-batch {mb} router {name!r}: expected "
                        f"integer indices, got {indices.dtype}"
                    )
                narrow = indices.detach().to(spec.dtype, copy=True)
                entries[name] = _Entry(narrow, checksum(narrow))
            stored.append(entries)
        self._steps[step] = stored

    def microbatches(self, step: int) -> int:
        return len(self._step(step))

    def get(self, step: int, microbatch: int) -> dict[str, torch.Tensor]:
        """The int64 routes of one micro-batch, after checking dtype, shape, range and checksum."""
        mbs = self._step(step)
        if not 0 <= microbatch < len(mbs):
            raise RouteCacheError(
                f"route cache: step {step} has micro-batches 0..{len(mbs) - 1}, not {microbatch}"
            )
        entries = mbs[microbatch]
        self._check_names(step, microbatch, entries.keys())
        flags = []
        for name, entry in entries.items():
            spec, t = self.specs[name], entry.indices
            where = f"route cache: step {step} micro-batch {microbatch} router {name!r}"
            if t.dtype != spec.dtype or t.dim() != 2 or t.shape[1] != spec.top_k:
                raise RouteCacheError(
                    f"{where}: expected [num_tokens, {spec.top_k}] {spec.dtype}, got "
                    f"{list(t.shape)} {t.dtype}"
                )
            wide = t.to(torch.int64)
            flags.append(
                torch.stack(
                    [
                        checksum(wide) != entry.checksum,
                        (wide < 0).any() | (wide >= spec.num_experts).any(),
                    ]
                )
            )
        bad = torch.stack(flags).tolist()
        problems = [
            f"router {name!r}: " + ("checksum mismatch" if cs else "index out of range")
            for name, (cs, rng) in zip(entries, bad, strict=True)
            if cs or rng
        ]
        if problems:
            raise RouteCacheError(
                f"route cache: step {step} micro-batch {microbatch} is corrupted: "
                + "; ".join(problems)
            )
        return {name: entry.indices.to(torch.int64) for name, entry in entries.items()}

    def drop(self, step: int) -> None:
        self._step(step)
        del self._steps[step]

    def clear(self) -> None:
        self._steps.clear()

    def _step(self, step: int) -> list[dict[str, _Entry]]:
        if step not in self._steps:
            cached = ", ".join(map(str, self.steps)) or "none"
            raise RouteCacheError(
                f"route cache: no routes for step {step} (cached steps: {cached})"
            )
        return self._steps[step]

    def _check_names(self, step: int, mb: int, names: Any) -> None:
        got, want = set(names), set(self.specs)
        if got != want:
            raise RouteCacheError(
                f"route cache: step {step} micro-batch {mb}: missing routers {sorted(want - got)}, "
                f"unknown routers {sorted(got - want)}"
            )

    def state_dict(self) -> dict[str, Any]:
        """CPU copies of every entry (indices and checksums), keyed by step."""
        return {
            "steps": {
                str(step): [
                    {
                        n: {"indices": _cpu_copy(e.indices), "checksum": _cpu_copy(e.checksum)}
                        for n, e in r.items()
                    }
                    for r in mbs
                ]
                for step, mbs in self._steps.items()
            }
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        """Replace the contents with a ``state_dict()``; nothing changes if it is malformed."""
        loaded: dict[int, list[dict[str, _Entry]]] = {}
        try:
            for step, mbs in state["steps"].items():
                entries = []
                for mb, routes in enumerate(mbs):
                    self._check_names(int(step), mb, routes.keys())
                    entries.append(
                        {
                            n: _Entry(
                                e["indices"].to(device, copy=True),
                                e["checksum"].to(device, copy=True),
                            )
                            for n, e in routes.items()
                        }
                    )
                loaded[int(step)] = entries
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise RouteCacheError(f"route cache: malformed state ({error!r})") from None
        self._steps = loaded


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return _copy_to(tensor, "cpu")


def _copy_to(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    return tensor.detach().to(device, copy=True)
