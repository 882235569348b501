"""Lazy package exports: ``ttnpu-train --help`` and ``ttnpu-drill --help`` import the package
but must not pay for torch and torchtitan (~20 s) before answering."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["exports"]


def exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from the module
    ``where[name]`` (relative to ``package`` when it starts with a dot) on first use (PEP 562)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name], package), name)

    return __getattr__
