"""The fused optimizers: one file each for hyper-parameters and state, one shared update path."""

from .adam import Adam, AdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD"]
