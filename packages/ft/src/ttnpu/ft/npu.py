"""The one place that calls torch_npu (Ascend): HCCL groups, device stop/restart, comm abort/resume.

Everything else in ttnpu.ft is device-agnostic. ``NpuRuntime`` takes the torch_npu module as an
argument so tests can hand it a recording fake and assert the exact call sequences.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.distributed_c10d import ProcessGroup as BaseProcessGroup

__all__ = ["NpuRuntime"]


class NpuRuntime:
    """Thin, typed access to the torch_npu calls fault tolerance needs."""

    def __init__(self, torch_npu: ModuleType | Any | None = None, device_type: str = "npu") -> None:
        self.torch_npu: Any = torch_npu if torch_npu is not None else _import_torch_npu()
        self.device_type = device_type

    def current_device(self) -> int:
        return int(self.torch_npu.npu.current_device())

    def create_process_group(
        self,
        store: Store,
        rank: int,
        world_size: int,
        *,
        timeout: timedelta,
        group_id: str,
        global_ranks: list[int] | None,
    ) -> tuple[BaseProcessGroup, Any]:
        """A c10d ProcessGroup backed by a native ProcessGroupHCCL; returns (group, backend)."""
        c10d = self.torch_npu._C._distributed_c10d
        opts = c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        opts.group_id = group_id
        if global_ranks:
            opts.global_ranks_in_group = global_ranks
        backend = c10d.ProcessGroupHCCL(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        pg._register_backend(
            torch.device(self.device_type), BaseProcessGroup.BackendType.CUSTOM, backend
        )
        return pg, backend

    def release_backend(self, backend: Any) -> None:
        """Abort the communicator, shut the backend down and drop its watchdog's work list."""
        backend.abort()
        backend.shutdown()
        backend.clear_workmeta_list()

    def stop_device(self, device_index: int) -> None:
        """Make queued device work fail with FORCE STOP and pause every HCCL watchdog."""
        status = self.torch_npu.npu.stop_device(device_index)
        if status:
            raise RuntimeError(f"torch_npu.npu.stop_device({device_index}) returned {status}")

    def abort_communicator(self, backend: Any) -> None:
        backend.abort_hccl_comm("reinit")

    def restart_device(self, device_index: int) -> None:
        """Clear FORCE STOP and the watchdogs' work lists, recover streams and resume watchdogs."""
        status = self.torch_npu.npu.restart_device(
            device_index, rebuild_all_resources=True, disable_tensor_unsafe_check=True
        )
        if status:
            raise RuntimeError(f"torch_npu.npu.restart_device({device_index}) returned {status}")

    def resume_communicator(self, backend: Any, device_index: int) -> None:
        """Resume a communicator that stop_device suspended (groups other than the rebuilt one)."""
        backend.resume_hccl_comm(device_index)

    def process_group_backends(self) -> list[Any]:
        """The HCCL backends of every live torch.distributed group (FSDP/EP groups)."""
        if not dist.is_initialized():
            return []
        backends = []
        for pg in list(dist.distributed_c10d._world.pg_map):
            try:
                backends.append(pg._get_backend(torch.device(self.device_type)))
            except RuntimeError:
                continue  # no backend for this device (a cpu/gloo group)
        return backends

    def set_op_timeout(self, timeout: timedelta) -> None:
        self.torch_npu.npu.set_op_timeout_ms(int(timeout.total_seconds() * 1000))

    def synchronize(self) -> None:
        self.torch_npu.npu.synchronize()

    def synchronize_stream(self) -> None:
        """Wait for the current stream only (not, say, a checkpoint's staging copies)."""
        self.torch_npu.npu.current_stream().synchronize()

    def empty_cache(self) -> None:
        self.torch_npu.npu.empty_cache()


def _import_torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise RuntimeError(
            "the npu device needs torch_npu and the CANN toolkit: pip install 'ttnpu-ft[npu]'"
        ) from e
