"""The fused optimizers, one file each: the class, its kernel's argument mirror and kernel spec,
and its torch form (which, run in float64, is also its test reference)."""

from .adagrad import Adagrad
from .adam import Adam, AdamW
from .lamb import LAMB
from .lion import Lion
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["LAMB", "SGD", "Adagrad", "Adam", "AdamW", "Lion", "RMSprop"]
