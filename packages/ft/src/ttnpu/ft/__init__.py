"""ttnpu-ft: replica-level fault tolerance on torchft for NPU, CUDA and CPU.

torchft provides the Lighthouse, the Manager (quorum, heal, commit), transports and process groups;
this package adds what they lack: an HCCL process group, in-process step recovery with per-device
adapters, a validated state carry-over for a rejoining replica, a cross-replica commit veto (which
also agrees a requested stop), replica-consistent MoE counters, split-brain detection (weights
fingerprints compared at a quorum), a Lighthouse embedded or as a restartable child process, and
replicas that ride through a Lighthouse restart.
"""

from importlib.metadata import version

from ttnpu.ft.devices import CpuAdapter, CudaAdapter, DeviceAdapter, NpuAdapter, select_adapter
from ttnpu.ft.fingerprint import SplitBrainCheck, SplitBrainError, weights_fingerprint
from ttnpu.ft.hccl import ProcessGroupHCCL
from ttnpu.ft.lighthouse import (
    EmbeddedLighthouse,
    LighthouseProcess,
    LighthouseStartError,
    LighthouseUnreachable,
    check_lighthouse,
)
from ttnpu.ft.moe_balance import expert_counters, sum_expert_counts_across_replicas
from ttnpu.ft.npu import NpuRuntime
from ttnpu.ft.recovery import (
    CollectiveTimeout,
    RecoveryLimitExceeded,
    StaleProcessGroup,
    StepRecovery,
)
from ttnpu.ft.reducer import GradientReducer
from ttnpu.ft.replica import LRScheduler, ReductionCheck, Replica, ReplicaConfig, StepResult
from ttnpu.ft.snapshot import ReplicaState, RestoreError, Stateful, snapshot_tree
from ttnpu.ft.training_site import SiteCleanup, StepStateOwner, clean_training_site
from ttnpu.ft.transport import SocketTransport
from ttnpu.ft.veto import CommitVeto, CommitVetoed, Vote
from ttnpu.ft.watchdog import CollectiveWatchdog, WatchdogToken

__version__ = version("ttnpu-ft")

__all__ = [
    "CollectiveTimeout",
    "CollectiveWatchdog",
    "CommitVeto",
    "CommitVetoed",
    "CpuAdapter",
    "CudaAdapter",
    "DeviceAdapter",
    "EmbeddedLighthouse",
    "GradientReducer",
    "LRScheduler",
    "LighthouseProcess",
    "LighthouseStartError",
    "LighthouseUnreachable",
    "NpuAdapter",
    "NpuRuntime",
    "ProcessGroupHCCL",
    "RecoveryLimitExceeded",
    "ReductionCheck",
    "Replica",
    "ReplicaConfig",
    "ReplicaState",
    "RestoreError",
    "SiteCleanup",
    "SocketTransport",
    "SplitBrainCheck",
    "SplitBrainError",
    "StaleProcessGroup",
    "Stateful",
    "StepRecovery",
    "StepResult",
    "StepStateOwner",
    "Vote",
    "WatchdogToken",
    "__version__",
    "check_lighthouse",
    "clean_training_site",
    "expert_counters",
    "select_adapter",
    "snapshot_tree",
    "sum_expert_counts_across_replicas",
    "weights_fingerprint",
]
