"""ttnpu-dsv4: DeepSeek-V4 in plain PyTorch, faithful to the published architecture and weights."""

from importlib.metadata import version

from .checkpoint import (
    CheckpointError,
    from_official,
    load_official_state_dict,
    load_pretrained,
    load_weights,
    save_pretrained,
    to_official,
)
from .config import DeepSeekV4Config
from .model import DeepSeekV4, LossTerms
from .moe import MoE, Router, update_expert_bias

__version__ = version("ttnpu-dsv4")
__all__ = [
    "CheckpointError",
    "DeepSeekV4",
    "DeepSeekV4Config",
    "LossTerms",
    "MoE",
    "Router",
    "__version__",
    "from_official",
    "load_official_state_dict",
    "load_pretrained",
    "load_weights",
    "save_pretrained",
    "to_official",
    "update_expert_bias",
]
