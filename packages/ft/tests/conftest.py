"""Shared fixtures: a recording fake of torch_npu, a TCPStore, a small model."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import Backend
from torch.distributed import TCPStore


class Recorder:
    """One ordered list of every call made into the fake torch_npu."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *call: Any) -> None:
        self.calls.append(call)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeHCCLOptions:
    def __init__(self) -> None:
        self._timeout: Any = None
        self.group_id = ""
        self.global_ranks_in_group: list[int] = []


def make_fake_hccl_class(rec: Recorder) -> type:
    class FakeProcessGroupHCCL(Backend):
        """Stands in for torch_npu's native backend; a real c10d Backend so it can be registered."""

        Options = FakeHCCLOptions
        created = 0

        def __init__(self, store: Any, rank: int, size: int, opts: FakeHCCLOptions) -> None:
            super().__init__(rank, size)
            FakeProcessGroupHCCL.created += 1
            self.name = f"hccl{FakeProcessGroupHCCL.created}"
            rec("ProcessGroupHCCL", rank, size, opts._timeout, opts.group_id)

        def _set_sequence_number_for_group(self) -> None:
            rec("_set_sequence_number_for_group", self.name)

        def abort(self) -> None:
            rec("abort", self.name)

        def shutdown(self) -> None:
            rec("shutdown", self.name)

        def clear_workmeta_list(self) -> None:
            rec("clear_workmeta_list", self.name)

        def abort_hccl_comm(self, reason: str) -> None:
            rec("abort_hccl_comm", self.name, reason)

        def resume_hccl_comm(self, device: int) -> None:
            rec("resume_hccl_comm", self.name, device)

    return FakeProcessGroupHCCL


class FakeTorchNpu:
    """The subset of torch_npu that ttnpu.ft calls, recording every call in order."""

    def __init__(self) -> None:
        self.rec = Recorder()
        rec = self.rec
        hccl = make_fake_hccl_class(rec)

        class _C10d:
            ProcessGroupHCCL = hccl

        class _C:
            _distributed_c10d = _C10d

        class npu:
            stop_status = 0

            @staticmethod
            def current_device() -> int:
                return 3

            @staticmethod
            def stop_device(index: int) -> int:
                rec("stop_device", index)
                return npu.stop_status

            @staticmethod
            def restart_device(
                index: int,
                rebuild_all_resources: bool = False,
                disable_tensor_unsafe_check: bool = False,
            ) -> int:
                rec("restart_device", index, rebuild_all_resources, disable_tensor_unsafe_check)
                return 0

            @staticmethod
            def synchronize() -> None:
                rec("synchronize")

            class _Stream:
                @staticmethod
                def synchronize() -> None:
                    rec("stream_synchronize")

            @staticmethod
            def current_stream() -> Any:
                return npu._Stream

            @staticmethod
            def empty_cache() -> None:
                rec("empty_cache")

            @staticmethod
            def set_op_timeout_ms(ms: int) -> None:
                rec("set_op_timeout_ms", ms)

        self._C = _C
        self.npu = npu


@pytest.fixture
def poll() -> Callable[[Callable[[], object]], None]:
    """Wait for a condition another thread makes true; the deadline is one no loaded host hits."""

    def wait(cond: Callable[[], object], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"condition not met within {timeout} s")
            time.sleep(0.01)

    return wait


@pytest.fixture
def fake_npu() -> FakeTorchNpu:
    return FakeTorchNpu()


@pytest.fixture
def store() -> Iterator[TCPStore]:
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    yield store


class MoELike(torch.nn.Module):
    """A module with per-step MoE state, as a model library would expose it."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("tokens_per_expert", torch.zeros(experts))
        self.aux_loss_sum = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tokens_per_expert += torch.arange(self.tokens_per_expert.numel())
        self.aux_loss_sum += 1.0
        return self.proj(x)

    def reset_step_state(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum = 0.0


class CounterOnly(torch.nn.Module):
    """A MoE layer that only has a counter (no reset method)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tokens_per_expert += 1
        return x


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), MoELike(), CounterOnly(), torch.nn.Linear(8, 1)
    )


@pytest.fixture
def model() -> torch.nn.Module:
    return small_model()


@pytest.fixture
def make_model() -> Any:
    return small_model
