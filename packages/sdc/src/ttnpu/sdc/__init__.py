"""ttnpu-sdc: Silent-data-corruption detection in computation and communication."""

from importlib.metadata import version

__version__ = version("ttnpu-sdc")
