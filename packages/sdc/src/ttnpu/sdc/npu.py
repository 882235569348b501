"""The torch_npu adapter: switch on the native detectors from an :class:`SDCConfig`.

torch_npu reads ``NPU_ASD_CONFIG`` / ``NPU_ASD_ENABLE`` once, when it is imported, and installs its
own gradient hooks and HCCL checks from them. This is the only module that touches torch_npu.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, MutableMapping
from types import ModuleType

from .config import SDCConfig

__all__ = ["enable_native_detection"]


def enable_native_detection(
    config: SDCConfig,
    *,
    environ: MutableMapping[str, str] | None = None,
    importer: Callable[[str], ModuleType] = importlib.import_module,
) -> ModuleType:
    """Write the native settings, then import torch_npu (which reads them); returns torch_npu.

    Refuses when torch_npu is already imported, since the settings would be silently ignored.
    With ``hccl_mode`` the process is put in training/backward state, which the native HCCL check
    needs to inspect the inputs of later collectives.
    """
    if "torch_npu" in sys.modules:
        raise RuntimeError(
            "enable_native_detection: torch_npu is already imported, so NPU_ASD_CONFIG and "
            "NPU_ASD_ENABLE would be ignored; call it before anything imports torch_npu"
        )
    env = os.environ if environ is None else environ
    env.update(config.npu_env())
    torch_npu = importer("torch_npu")
    if config.hccl_mode:
        torch_npu._C._npu_set_module_train_state("train")
        torch_npu._C._npu_set_call_state("backward")
    return torch_npu
