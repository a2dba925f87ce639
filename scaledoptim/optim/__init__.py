"""The fused optimizers: one file each for hyper-parameters, state and the update's two forms."""

from .adagrad import Adagrad
from .adam import Adam, AdamW
from .fused import FusedOptimizer
from .lamb import LAMB
from .lion import Lion
from .sgd import SGD

__all__ = ["LAMB", "SGD", "Adagrad", "Adam", "AdamW", "FusedOptimizer", "Lion"]
