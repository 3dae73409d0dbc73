"""Several ranks: how the model is split (`layout`) and the collectives its parts run (`comm`).

A layer of its own between kernels and model: the model imports it to build one rank's part and to sum partial
outputs; it imports nothing of the model.
"""

from .comm import Communicator
from .layout import Layout, LayoutError, Shard, Split

__all__ = ["Communicator", "Layout", "LayoutError", "Shard", "Split"]
