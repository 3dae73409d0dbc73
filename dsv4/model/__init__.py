"""The DeepSeek-V4 forward in PyTorch. Linear layers keep their stored format and compute through `Ops`."""

from .linear import DENSE, Builder, LinearFormat, QLinear
from .transformer import Block, MTPBlock, Transformer, build_model

__all__ = ["Builder", "Block", "DENSE", "LinearFormat", "MTPBlock", "QLinear", "Transformer", "build_model"]
