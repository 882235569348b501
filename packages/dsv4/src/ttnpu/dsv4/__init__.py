"""ttnpu-dsv4: DeepSeek-V4 in plain PyTorch."""

from importlib.metadata import version

__version__ = version("ttnpu-dsv4")
