"""ttnpu-trainer: a torchtitan trainer for DeepSeek-V4 that composes the ttnpu libraries."""

from importlib.metadata import version

__version__ = version("ttnpu-trainer")
