"""Per-device adapters: which torchft process group to use and how to stop/restart device work.

The recovery sequence is the same everywhere (stop device work, abort communicators, clean the
training site, restart); only these few calls differ between cpu (gloo), cuda (nccl) and npu (hccl).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
from torchft.process_group import ProcessGroup, ProcessGroupGloo, ProcessGroupNCCL

from ttnpu.ft.hccl import ProcessGroupHCCL
from ttnpu.ft.npu import NpuRuntime

__all__ = ["CpuAdapter", "CudaAdapter", "DeviceAdapter", "NpuAdapter", "select_adapter"]


class DeviceAdapter(Protocol):
    """What recovery needs from a device family."""

    kind: str

    @property
    def device(self) -> torch.device: ...

    def process_group(self, timeout: timedelta, recovery_timeout: timedelta) -> ProcessGroup: ...

    def synchronize(self) -> None: ...

    def synchronize_stream(self) -> None: ...

    def stop_device(self) -> None: ...

    def abort_communicators(self, pg: ProcessGroup) -> None: ...

    def restart_device(self) -> None: ...

    def empty_cache(self) -> None: ...


class CpuAdapter:
    """gloo: nothing queued on a device; a blocked collective ends at the gloo timeout."""

    kind = "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def process_group(self, timeout: timedelta, recovery_timeout: timedelta) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timeout)

    def synchronize(self) -> None:
        pass

    def synchronize_stream(self) -> None:
        pass

    def stop_device(self) -> None:
        pass

    def abort_communicators(self, pg: ProcessGroup) -> None:
        pg.abort()

    def restart_device(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class CudaAdapter:
    """nccl: torchft's ProcessGroupNCCL aborts the communicator, which unblocks queued kernels."""

    kind = "cuda"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def process_group(self, timeout: timedelta, recovery_timeout: timedelta) -> ProcessGroup:
        return ProcessGroupNCCL(timeout=timeout)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def synchronize_stream(self) -> None:
        torch.cuda.current_stream().synchronize()

    def stop_device(self) -> None:
        pass

    def abort_communicators(self, pg: ProcessGroup) -> None:
        pg.abort()

    def restart_device(self) -> None:
        pass

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class NpuAdapter:
    """hccl: stop_device fails queued work (FORCE STOP); resume + restart_device bring it back."""

    kind = "npu"

    def __init__(self, runtime: NpuRuntime | None = None) -> None:
        self.runtime = runtime if runtime is not None else NpuRuntime()
        self._groups: list[ProcessGroupHCCL] = []

    @property
    def device(self) -> torch.device:
        return torch.device(self.runtime.device_type, self.runtime.current_device())

    def process_group(self, timeout: timedelta, recovery_timeout: timedelta) -> ProcessGroup:
        pg = ProcessGroupHCCL(timeout, recovery_timeout=recovery_timeout, runtime=self.runtime)
        self._groups.append(pg)
        return pg

    def synchronize(self) -> None:
        self.runtime.synchronize()

    def synchronize_stream(self) -> None:
        self.runtime.synchronize_stream()

    def stop_device(self) -> None:
        self.runtime.stop_device(self.runtime.current_device())

    def abort_communicators(self, pg: ProcessGroup) -> None:
        backend = pg.backend if isinstance(pg, ProcessGroupHCCL) else None
        if backend is not None:
            self.runtime.abort_communicator(backend)
        pg.abort()

    def restart_device(self) -> None:
        index = self.runtime.current_device()
        # stop_device suspended every HCCL communicator. The aborted torchft group is rebuilt at
        # the next quorum; the others (the replica's own FSDP/EP groups, other live torchft
        # groups) resume in place. The order is MindSpeed-LLM's step retry, the one used on Ascend:
        # resume the communicators first (its reinit_process_group(rebuild_link=False) is
        # resume_hccl_comm on every group), then restart_device, which clears FORCE STOP and sets
        # the watchdogs running again. The reverse order has not been run on Ascend.
        live = [group.backend for group in self._groups if group.backend is not None]
        for backend in [*live, *self.runtime.process_group_backends()]:
            self.runtime.resume_communicator(backend, index)
        self.runtime.restart_device(index)

    def empty_cache(self) -> None:
        self.runtime.empty_cache()


def select_adapter(device: str | None = None) -> DeviceAdapter:
    """The adapter for ``device`` ("cpu", "cuda", "npu"), or for the available accelerator.

    Decided from ``torch.accelerator.is_available()``: a CUDA build of torch on a machine without a
    GPU still reports cuda as its ``current_accelerator()``.
    """
    if device is None:
        accelerator = torch.accelerator.current_accelerator()
        available = torch.accelerator.is_available() and accelerator is not None
        device = accelerator.type if available and accelerator is not None else "cpu"
    adapters: dict[str, type[CpuAdapter] | type[CudaAdapter] | type[NpuAdapter]] = {
        "cpu": CpuAdapter,
        "cuda": CudaAdapter,
        "npu": NpuAdapter,
    }
    if device not in adapters:
        raise ValueError(f"device must be one of {sorted(adapters)}, got {device!r}")
    return adapters[device]()
