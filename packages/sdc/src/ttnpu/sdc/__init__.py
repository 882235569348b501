"""ttnpu-sdc: silent-data-corruption detection in computation and communication.

Matmul checksums (:func:`check_matmul`, :class:`ChecksumMode`, :func:`install_checksum_pass`),
gradient feature-value detection (:class:`GradientDetector`), verified collectives
(:class:`CollectiveChecker`), one event type with pluggable actions (:class:`Reporter`), bit-flip
fault injection (:mod:`ttnpu.sdc.inject`) and the torch_npu adapter
(:func:`enable_native_detection`).
"""

from importlib import import_module
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from .checksum import (
    SIGMAS,
    CheckResult,
    check_grouped_mm,
    check_matmul,
    screen_grouped_mm,
    screen_matmul,
    unit_roundoff,
)
from .comm import CollectiveChecker, ReductionChecksums, chunk_length
from .config import SDCConfig
from .eager import ChecksumMode
from .events import (
    Action,
    EventLog,
    LogAction,
    RaiseAction,
    Reporter,
    SDCError,
    SDCEvent,
    VetoFlag,
    default_reporter,
    set_default_reporter,
)
from .gradient import GradientDetector, StrikePolicy
from .inject import (
    BitFlip,
    FaultPlan,
    MatmulFaultMode,
    arm_compiled_fault,
    disarm_compiled_fault,
    flip_bit,
)
from .npu import enable_native_detection
from .sites import CheckStats, compile_screens
from .switch import BACKGROUND_SAMPLE_STEPS, ChecksumSwitch, checksum_switch

if TYPE_CHECKING:
    from .compiled import (
        ChecksumGraphPass,
        checksum_compile_options,
        compiled_stats,
        install_checksum_pass,
        uninstall_checksum_pass,
    )
    from .fsdp import CheckedReduceScatter, check_fsdp_reduce_scatter

__version__ = version("ttnpu-sdc")

_LAZY = {
    "ChecksumGraphPass": ".compiled",
    "checksum_compile_options": ".compiled",
    "compiled_stats": ".compiled",
    "install_checksum_pass": ".compiled",
    "uninstall_checksum_pass": ".compiled",
    "CheckedReduceScatter": ".fsdp",
    "check_fsdp_reduce_scatter": ".fsdp",
}


def __getattr__(name: str) -> Any:
    """The compiled-mode names import torch._inductor (seconds), the FSDP2 ones
    torch.distributed.fsdp (half a second): only when first used."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKGROUND_SAMPLE_STEPS",
    "SIGMAS",
    "Action",
    "BitFlip",
    "CheckResult",
    "CheckStats",
    "CheckedReduceScatter",
    "ChecksumGraphPass",
    "ChecksumMode",
    "ChecksumSwitch",
    "CollectiveChecker",
    "EventLog",
    "FaultPlan",
    "GradientDetector",
    "LogAction",
    "MatmulFaultMode",
    "RaiseAction",
    "ReductionChecksums",
    "Reporter",
    "SDCConfig",
    "SDCError",
    "SDCEvent",
    "StrikePolicy",
    "VetoFlag",
    "__version__",
    "arm_compiled_fault",
    "check_fsdp_reduce_scatter",
    "check_grouped_mm",
    "check_matmul",
    "checksum_compile_options",
    "checksum_switch",
    "chunk_length",
    "compile_screens",
    "compiled_stats",
    "default_reporter",
    "disarm_compiled_fault",
    "enable_native_detection",
    "flip_bit",
    "install_checksum_pass",
    "screen_grouped_mm",
    "screen_matmul",
    "set_default_reporter",
    "uninstall_checksum_pass",
    "unit_roundoff",
]
