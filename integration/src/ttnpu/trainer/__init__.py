"""ttnpu-trainer: a torchtitan trainer for DeepSeek-V4 that composes the ttnpu libraries.

The exports are imported on first use (torch and torchtitan load only then)."""

from importlib.metadata import version
from typing import TYPE_CHECKING

from ._lazy import exports

if TYPE_CHECKING:
    from ttnpu.dsv4.titan import DeepSeekV4LM, model_spec

    from .checkpoint import ChecksummedCheckpointManager
    from .config_registry import CONFIGS
    from .corpus import DATASET_NAME, corpus_path, load_corpus, tokenizer_path
    from .features import (
        EXIT_LIGHTHOUSE_LOST,
        EXIT_PERSISTENT_SDC,
        EXIT_SPLIT_BRAIN,
        FaultTolerance,
        PersistentSDCError,
        SilentDataCorruption,
        SpikeRecovery,
    )
    from .platform import Platform, activate, detect
    from .run_folder import (
        CheckpointError,
        newest_verified_checkpoint,
        verify_checkpoint,
        write_checksums,
    )
    from .trainer import DSV4Trainer

__version__ = version("ttnpu-trainer")
_EXPORTS = {
    "CONFIGS": ".config_registry",
    "CheckpointError": ".run_folder",
    "ChecksummedCheckpointManager": ".checkpoint",
    "DATASET_NAME": ".corpus",
    "DSV4Trainer": ".trainer",
    "DeepSeekV4LM": "ttnpu.dsv4.titan",
    "EXIT_PERSISTENT_SDC": ".features",
    "EXIT_LIGHTHOUSE_LOST": ".features",
    "EXIT_SPLIT_BRAIN": ".features",
    "FaultTolerance": ".features",
    "PersistentSDCError": ".features",
    "Platform": ".platform",
    "SilentDataCorruption": ".features",
    "SpikeRecovery": ".features",
    "activate": ".platform",
    "corpus_path": ".corpus",
    "detect": ".platform",
    "load_corpus": ".corpus",
    "model_spec": "ttnpu.dsv4.titan",
    "newest_verified_checkpoint": ".run_folder",
    "tokenizer_path": ".corpus",
    "verify_checkpoint": ".run_folder",
    "write_checksums": ".run_folder",
}
__getattr__ = exports(__name__, _EXPORTS)
__all__ = [
    "CONFIGS",
    "DATASET_NAME",
    "EXIT_LIGHTHOUSE_LOST",
    "EXIT_PERSISTENT_SDC",
    "EXIT_SPLIT_BRAIN",
    "CheckpointError",
    "ChecksummedCheckpointManager",
    "DSV4Trainer",
    "DeepSeekV4LM",
    "FaultTolerance",
    "PersistentSDCError",
    "Platform",
    "SilentDataCorruption",
    "SpikeRecovery",
    "__version__",
    "activate",
    "corpus_path",
    "detect",
    "load_corpus",
    "model_spec",
    "newest_verified_checkpoint",
    "tokenizer_path",
    "verify_checkpoint",
    "write_checksums",
]
