"""The platform module: device choice, torchtitan bound to it, and the CPU/NPU adaptations."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils
from torchtitan.components.metrics import DeviceMemoryMonitor
from torchtitan.distributed import ParallelDims

from ttnpu.trainer.platform import CpuDeviceModule, activate, detect

_TORCHTITAN_COPIES = (tt_utils, tt_metrics, tt_dist_utils, tt_parallel_dims)


@pytest.fixture
def restore_binding() -> Iterator[None]:
    """Put every torchtitan module's device globals back as they were after each test."""
    saved = [
        (module, name, vars(module)[name])
        for key, module in list(sys.modules.items())
        if key.startswith("torchtitan") and module is not None
        for name in ("device_type", "device_module")
        if name in vars(module)
    ]
    yield
    for module, name, value in saved:
        setattr(module, name, value)


def test_detect_without_an_accelerator_is_cpu_even_though_current_accelerator_says_cuda() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    assert detect() == "cpu"
    assert detect("auto") == "cpu"


def test_detect_honours_an_explicit_device_and_rejects_unknown_ones() -> None:
    assert detect("npu") == "npu"
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        detect("tpu")


@pytest.mark.usefixtures("restore_binding")
def test_activate_cpu_rebinds_every_torchtitan_copy_of_the_device() -> None:
    result = activate("cpu")
    assert (result.device_type, result.backend) == ("cpu", "gloo")
    for module in _TORCHTITAN_COPIES:
        assert module.device_type == "cpu", module.__name__
    for module in (tt_utils, tt_metrics, tt_dist_utils):
        assert module.device_module is result.device_module, module.__name__
    # What the Trainer asks first: its device (LOCAL_RANK picks the index).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_RANK", "0")
        assert tt_utils.get_local_device() == torch.device("cpu", 0)


@pytest.mark.usefixtures("restore_binding")
def test_torchtitans_memory_monitor_runs_on_the_cpu_device_module() -> None:
    activate("cpu")
    monitor = DeviceMemoryMonitor("cpu")
    stats = monitor.get_peak_stats()
    assert monitor.device_capacity > 1 << 30
    assert 0 < stats.max_reserved_gib < monitor.device_capacity_gib
    assert stats.num_ooms == 0


@pytest.mark.usefixtures("restore_binding")
def test_set_pg_timeouts_barrier_runs_on_gloo() -> None:
    """torchtitan passes device_module.current_device() to barrier(device_ids=...) after step 1."""
    activate("cpu")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        tt_dist_utils.set_pg_timeouts(timedelta(seconds=30), dims)
    finally:
        dist.destroy_process_group()


def test_cpu_device_module_answers_torchtitans_calls() -> None:
    module = CpuDeviceModule()
    assert module.current_device() == 0 and module.device_count() == 1
    assert module.get_device_properties().total_memory > 0
    assert module.memory_stats()["reserved_bytes.all.peak"] > 0
    assert module.is_available is torch.cpu.is_available  # everything else is torch.cpu


def test_activate_cuda_without_a_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        activate("cuda")


_FAKE_TORCH_NPU = """
import types, torch, torch.distributed as dist
calls = ["import torch_npu"]
npu = types.ModuleType("torch_npu.npu")
if {registers}:
    torch.npu = npu
    dist.Backend.default_device_backend_map["npu"] = "hccl"
    calls.append("register torch.npu + hccl")
"""


@pytest.fixture
def fake_torch_npu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[bool], None]]:
    """A recording stand-in for torch_npu on sys.path: importing it registers the npu device
    module and HCCL (when ``registers``), as the real one does, and records each step."""

    def install(registers: bool) -> None:
        (tmp_path / "torch_npu.py").write_text(_FAKE_TORCH_NPU.format(registers=registers))
        monkeypatch.syspath_prepend(str(tmp_path))

    # Placeholders, so that the teardown removes whatever the fake registers.
    monkeypatch.setattr(torch, "npu", None, raising=False)
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "npu", "unregistered")
    yield install
    sys.modules.pop("torch_npu", None)


@pytest.mark.usefixtures("restore_binding")
def test_activate_npu_imports_torch_npu_once_and_binds_torchtitan_to_torch_npu(
    fake_torch_npu: Callable[[bool], None],
) -> None:
    fake_torch_npu(True)
    result = activate("npu")
    fake = sys.modules["torch_npu"]
    assert fake.calls == ["import torch_npu", "register torch.npu + hccl"]
    assert (result.device_type, result.backend, result.device_module) == ("npu", "hccl", fake.npu)
    assert tt_utils.device_type == "npu" and tt_utils.device_module is fake.npu
    activate("npu")
    assert fake.calls == ["import torch_npu", "register torch.npu + hccl"]  # imported once


def test_activate_npu_when_torch_npu_does_not_register_is_a_clear_error(
    fake_torch_npu: Callable[[bool], None],
) -> None:
    fake_torch_npu(False)
    with pytest.raises(RuntimeError, match=r"did not register the torch\.npu device module"):
        activate("npu")


def test_activate_npu_without_torch_npu_is_a_clear_error(
    fake_torch_npu: Callable[[bool], None],
) -> None:
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        activate("npu")


@pytest.mark.npu
def test_activate_npu_on_ascend() -> None:
    pytest.importorskip("torch_npu", reason="needs torch_npu and an Ascend device")
    result = activate(detect())
    assert (result.device_type, result.backend) == ("npu", "hccl")
    assert result.device_module.device_count() >= 1
