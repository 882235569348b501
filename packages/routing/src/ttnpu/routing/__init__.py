"""ttnpu-routing: loss-spike detection, rollback planning and anticipatory MoE routing.

Detect a spike (``LossSpikeDetector``), pick the checkpoint to restore (``plan_rollback``), then
run ``AnticipatorySchedule``: routes of upcoming batches are captured ahead through the ``Router``
protocol and replayed when those batches are trained on.
"""

from importlib.metadata import version

from ttnpu.routing.cache import RouteCache, RouteCacheError, RouterSpec, index_dtype
from ttnpu.routing.data import PeekableIterator, StatefulIterable
from ttnpu.routing.detector import DetectorConfig, LossSpikeDetector
from ttnpu.routing.protocol import Router, find_routers
from ttnpu.routing.rollback import (
    REQUIRED_PARTS,
    CheckpointInfo,
    NoRollbackTargetError,
    RollbackPlan,
    plan_rollback,
)
from ttnpu.routing.routers import RouteReplayError, RouterSet
from ttnpu.routing.schedule import (
    AnticipatorySchedule,
    DataExhaustedError,
    Phase,
    ScheduleConfig,
    TrainingStep,
)

__version__ = version("ttnpu-routing")

__all__ = [
    "REQUIRED_PARTS",
    "AnticipatorySchedule",
    "CheckpointInfo",
    "DataExhaustedError",
    "DetectorConfig",
    "LossSpikeDetector",
    "NoRollbackTargetError",
    "PeekableIterator",
    "Phase",
    "RollbackPlan",
    "RouteCache",
    "RouteCacheError",
    "RouteReplayError",
    "Router",
    "RouterSet",
    "RouterSpec",
    "ScheduleConfig",
    "StatefulIterable",
    "TrainingStep",
    "__version__",
    "find_routers",
    "index_dtype",
    "plan_rollback",
]
