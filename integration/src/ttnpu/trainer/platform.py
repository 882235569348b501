"""The device this process trains on, and what torchtitan 0.3 needs to run there.

torchtitan 0.3 assumes an accelerator: ``torchtitan.tools.utils`` picks its device at import as
``_get_available_device_type() or "cuda"``, and other modules copy that choice with
``from torchtitan.tools.utils import device_type, device_module``. With the CUDA build of torch on a
machine without a GPU that choice is "cuda" and the trainer dies in ``set_device``.
``torch.accelerator.current_accelerator()`` also says "cuda" there, so the device is decided from
``torch.accelerator.is_available()`` or an explicit setting, never from ``current_accelerator()``
alone.

:func:`activate` binds torchtitan to the chosen device without touching torchtitan's files:

* **cpu** (gloo): torchtitan's ``device_type`` / ``device_module`` globals are rebound to ``"cpu"``
  and :class:`CpuDeviceModule`. That object stands in for ``torch.cuda`` where torchtitan calls it:
  the memory monitor needs a device name, a total memory, memory stats and peak resets (answered
  from the host: physical RAM and the process's peak RSS); ``set_pg_timeouts`` passes
  ``current_device()`` to ``barrier(device_ids=...)``, which needs an index (``torch.cpu`` answers
  the string "cpu"). ``init_process_group`` then picks gloo from torch's device-backend map.
* **cuda** (nccl): torchtitan's own choice; nothing is adapted.
* **npu** (hccl): ``torch_npu`` is imported through :mod:`ttnpu.trainer._npu`, which registers the
  ``npu`` device module and the HCCL backend; torchtitan is then bound to ``torch.npu``.
"""

from __future__ import annotations

import os
import platform as _host
import resource
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["DEVICE_TYPES", "CpuDeviceModule", "DeviceType", "Platform", "activate", "detect"]

DeviceType = Literal["cpu", "cuda", "npu"]
DEVICE_TYPES: tuple[DeviceType, ...] = ("cpu", "cuda", "npu")
_BACKENDS: dict[DeviceType, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Platform:
    """Where this process trains: torch device type, collective backend and torchtitan's device
    module (the object it calls ``set_device``, ``synchronize`` and the memory stats on)."""

    device_type: DeviceType
    backend: str
    device_module: Any


class CpuDeviceModule:
    """``torch.cpu`` (``set_device``, ``synchronize``, ``device_count``, ...) plus the accelerator
    calls torchtitan makes that ``torch.cpu`` lacks, answered for the host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        # torch.cpu answers "cpu"; barrier(device_ids=[...]) needs an index.
        return 0

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        # The kernel keeps the process's peak RSS and offers no reset; stats stay cumulative.
        pass

    def get_device_name(self, device: Any = None) -> str:
        return _host.processor() or _host.machine() or "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return _Properties(total_memory=total)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


@dataclass(frozen=True)
class _Properties:
    total_memory: int


def detect(requested: str | None = None) -> DeviceType:
    """The device type to train on: ``requested`` if given (and not "auto"), else the available
    accelerator (NPU when ``torch_npu`` is installed and sees a device), else cpu."""
    if requested not in (None, "", "auto"):
        if requested not in DEVICE_TYPES:
            raise ValueError(f"device {requested!r} is not one of {['auto', *DEVICE_TYPES]}")
        return requested
    from . import _npu

    if _npu.installed():
        _npu.register()
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type in DEVICE_TYPES:
            return accelerator.type
    return "cpu"


def activate(device_type: DeviceType) -> Platform:
    """Bind torchtitan (imported or not yet) to ``device_type`` and return the platform."""
    if device_type == "cpu":
        module: Any = CpuDeviceModule()
    elif device_type == "npu":
        from . import _npu

        module = _npu.register()
    elif device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was requested but torch.cuda.is_available() is False")
        module = torch.cuda
    else:
        raise ValueError(f"device {device_type!r} is not one of {list(DEVICE_TYPES)}")
    backend = torch.distributed.Backend.default_device_backend_map.get(device_type)
    if backend != _BACKENDS[device_type]:
        raise RuntimeError(
            f"torch maps device {device_type!r} to backend {backend!r}, expected "
            f"{_BACKENDS[device_type]!r}"
        )
    _bind_torchtitan(device_type, module)
    return Platform(device_type=device_type, backend=backend, device_module=module)


def _bind_torchtitan(device_type: str, device_module: Any) -> None:
    """Rebind ``device_type`` / ``device_module`` in torchtitan's utils and in every torchtitan
    module that already copied them with ``from torchtitan.tools.utils import ...``."""
    import torchtitan.tools.utils as tt_utils

    stale_type, stale_module = tt_utils.device_type, tt_utils.device_module
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        namespace = vars(module)
        if namespace.get("device_module") is stale_module:
            module.device_module = device_module  # type: ignore[attr-defined]
        if isinstance(namespace.get("device_type"), str) and namespace["device_type"] == stale_type:
            module.device_type = device_type  # type: ignore[attr-defined]
