"""ttnpu-routing: Loss-spike detection, rollback planning and anticipatory MoE routing."""

from importlib.metadata import version

__version__ = version("ttnpu-routing")
