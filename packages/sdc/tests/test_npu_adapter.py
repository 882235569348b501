"""torch_npu is not installed here: the adapter is checked against a recording fake."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType, SimpleNamespace

import pytest

from ttnpu.sdc import SDCConfig, enable_native_detection


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"SDCConfig\.upper_thresh2 must be >= 3"):
        SDCConfig(upper_thresh2=2)
    with pytest.raises(TypeError, match=r"SDCConfig\.cooldown must be int"):
        SDCConfig(cooldown=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hccl_mode must be 0-3"):
        SDCConfig(hccl_mode=4)
    with pytest.raises(ValueError, match="with_checksum needs gradient_enabled"):
        SDCConfig(gradient_enabled=False)


def test_npu_env_matches_torch_npu_keys_and_defaults() -> None:
    env = SDCConfig(hccl_mode=2).npu_env()
    assert env == {
        "NPU_ASD_CONFIG": "enable:true,with_checksum:true,cooldown:5,strikes_num:3,"
        "strikes_window:480,checksum_cooldown:180,upper_thresh1:1000000,upper_thresh2:100,"
        "grad_sample_interval:3",
        "NPU_ASD_ENABLE": "2",
    }
    assert SDCConfig(gradient_enabled=False, with_checksum=False).npu_env() == {}


class _RecordingImporter:
    """Imports a fake torch_npu and records the environment it sees and the calls made on it."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.env_at_import: dict[str, str] | None = None

    def __call__(self, name: str) -> ModuleType:
        assert name == "torch_npu"
        self.env_at_import = dict(self.environ)
        self.calls.append(("import", (name,)))
        module = ModuleType("torch_npu")

        def record(fn: str):
            return lambda *args: self.calls.append((fn, args))

        module._C = SimpleNamespace(  # type: ignore[attr-defined]
            _npu_set_module_train_state=record("_npu_set_module_train_state"),
            _npu_set_call_state=record("_npu_set_call_state"),
        )
        return module


def test_settings_are_written_before_torch_npu_is_imported() -> None:
    environ: dict[str, str] = {}
    importer = _RecordingImporter(environ)
    enable_native_detection(SDCConfig(hccl_mode=1), environ=environ, importer=importer)
    assert importer.env_at_import == SDCConfig(hccl_mode=1).npu_env()
    assert importer.calls == [
        ("import", ("torch_npu",)),
        ("_npu_set_module_train_state", ("train",)),
        ("_npu_set_call_state", ("backward",)),
    ]
    importer = _RecordingImporter(environ)
    enable_native_detection(SDCConfig(), environ=environ, importer=importer)
    assert importer.calls == [("import", ("torch_npu",))]  # no HCCL check: no state calls


def test_refuses_once_torch_npu_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    with pytest.raises(RuntimeError, match="already imported"):
        enable_native_detection(SDCConfig(), environ={})


@pytest.mark.npu
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason="needs torch_npu")
def test_native_detection_on_ascend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    torch_npu = enable_native_detection(SDCConfig(hccl_mode=1))
    assert torch_npu.npu.is_available()
