"""The one place ttnpu-trainer calls torch_npu: importing it registers the ``npu`` device module
(``torch.npu``) and the HCCL collective backend with torch."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

__all__ = ["installed", "register"]


def installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def register() -> ModuleType:
    """Import torch_npu and return ``torch.npu``; clear errors if either step does not happen."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as err:
        raise RuntimeError(
            "device 'npu' needs torch_npu (install ttnpu-trainer[npu] and the CANN toolkit)"
        ) from err
    module = getattr(torch, "npu", None)
    if not isinstance(module, ModuleType):
        raise RuntimeError("importing torch_npu did not register the torch.npu device module")
    return module
