"""ttnpu-trainer: a torchtitan trainer for DeepSeek-V4 that composes the ttnpu libraries."""

from importlib.metadata import version

from ttnpu.dsv4.titan import DeepSeekV4LM, model_spec

from .checkpoint import ChecksummedCheckpointManager
from .config_registry import CONFIGS
from .corpus import DATASET_NAME, corpus_path, load_corpus, tokenizer_path
from .features import (
    EXIT_PERSISTENT_SDC,
    FaultTolerance,
    PersistentSDCError,
    SilentDataCorruption,
    SpikeRecovery,
)
from .platform import Platform, activate, detect
from .run_folder import CheckpointError, newest_checkpoint, verify_checkpoint, write_checksums
from .trainer import DSV4Trainer

__version__ = version("ttnpu-trainer")
__all__ = [
    "CONFIGS",
    "DATASET_NAME",
    "EXIT_PERSISTENT_SDC",
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
    "newest_checkpoint",
    "tokenizer_path",
    "verify_checkpoint",
    "write_checksums",
]
