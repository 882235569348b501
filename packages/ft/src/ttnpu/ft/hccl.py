"""A reconfigurable, abortable torchft process group for HCCL (torchft ships none for Ascend).

torchft's Manager calls ``configure(store_addr, ...)`` on every new quorum with the address
``<store>/torchft/<quorum_id>/<group_rank>``. Each configuration builds a fresh native
ProcessGroupHCCL whose own watchdog timeout is longer than the Python recovery path (collective
timeout + recovery timeout + margin), so ttnpu's recovery always acts before HCCL tears the process
down.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.distributed_c10d import ProcessGroup as BaseProcessGroup
from torchft.process_group import ProcessGroupWrapper

from ttnpu.ft.npu import NpuRuntime

__all__ = ["ProcessGroupHCCL"]

WATCHDOG_MARGIN = timedelta(seconds=30)


class ProcessGroupHCCL(ProcessGroupWrapper):
    """torchft ProcessGroup over HCCL: one native group per quorum, fresh store prefix each time."""

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        *,
        recovery_timeout: timedelta = timedelta(seconds=60),
        runtime: NpuRuntime | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self.runtime = runtime if runtime is not None else NpuRuntime()
        self.recovery_timeout = recovery_timeout
        self._backend: Any | None = None
        self._errored: Exception | None = None
        self._used_store_addrs: set[str] = set()

    @property
    def watchdog_timeout(self) -> timedelta:
        """The native HCCL watchdog's timeout: strictly after ours has had its chance."""
        return self._timeout + self.recovery_timeout + WATCHDOG_MARGIN

    @property
    def backend(self) -> Any | None:
        """The native ProcessGroupHCCL of the current quorum (None between quorums)."""
        return self._backend

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        if store_addr in self._used_store_addrs:
            raise ValueError(
                f"ProcessGroupHCCL.configure: store address {store_addr!r} was already used; HCCL "
                "must never rendezvous on stale keys (each quorum needs a fresh prefix)"
            )
        self._used_store_addrs.add(store_addr)
        self._errored = None
        super().configure(
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        group_rank = self._group_rank or 0
        pg, self._backend = self.runtime.create_process_group(
            store,
            rank,
            world_size,
            timeout=self.watchdog_timeout,
            group_id=f"torchft_quorum_{self._quorum_id}_rank_{group_rank}",
            global_ranks=self._global_ranks,
        )
        return pg

    def abort(self, errored: bool = True) -> None:
        """Abort the communicator, shut the backend down, clear its work list; idempotent."""
        if errored:
            self._errored = RuntimeError("ProcessGroupHCCL aborted")
        backend, self._backend = self._backend, None
        if backend is not None:
            self.runtime.release_backend(backend)
        self._pg = None

    def shutdown(self) -> None:
        self.abort(errored=False)

    def errored(self) -> Exception | None:
        return self._errored

    def getBackendName(self) -> str:
        return "torchft-hccl"
