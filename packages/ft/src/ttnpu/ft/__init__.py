"""ttnpu-ft: Replica-level fault tolerance on torchft for NPU, CUDA and CPU."""

from importlib.metadata import version

__version__ = version("ttnpu-ft")
