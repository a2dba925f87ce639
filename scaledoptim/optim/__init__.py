"""The optimizers, one file each: the class, its options, its kernel's argument mirror and kernel
spec, its torch form (which, run in float64, is also its test reference) and its
:class:`~scaledoptim.optim.spec.OptimizerSpec`.

Each import below registers one optimizer: importing its module declares its spec, and the
package's exports, the tests' optimizer table and the docs site's list derive from the specs
(Note [an optimizer declared once] in spec.py).
"""

from .adagrad import Adagrad as Adagrad
from .adam import Adam as Adam
from .adam import AdamW as AdamW
from .lamb import LAMB as LAMB
from .lbfgs import LBFGS as LBFGS
from .lion import Lion as Lion
from .rmsprop import RMSprop as RMSprop
from .sgd import SGD as SGD
from .spec import registered as _registered

# What `from scaledoptim.optim import *` gives (scaledoptim's exports), derived; set through
# globals() so that static readers (mypy, griffe) read the re-exports above instead of an
# expression they cannot evaluate.
globals()["__all__"] = [spec.name for spec in _registered()]
