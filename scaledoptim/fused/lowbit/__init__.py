"""Low-bit optimizer states: a fused optimizer's moments as 8-bit block-wise codes
(``state_bits=8``).

* ``codes.py``: the 8-bit codes (Note [block-wise codes], Note [dithered rounding]).
* ``blockwise.py``: block-wise quantization with torch ops.
* ``form.py``: the torch form over low-bit states, a batch of blocks at a time (Note [low-bit
  batches]); the kernels' is ``cuda/blockwise_quant.cuh``.
* ``states.py``: the options, and an optimizer's low-bit variant (Note [low-bit variants]).
"""

from .blockwise import block_count, dequantize_blockwise, quantize_blockwise
from .codes import SIGNED, UNSIGNED, Code
from .states import (
    LowBitStates,
    check_float32_states,
    check_state_bits,
    lowbit_fields,
    lowbit_kernel,
    lowbit_new,
    lowbit_options,
)

__all__ = [
    "SIGNED",
    "UNSIGNED",
    "Code",
    "LowBitStates",
    "block_count",
    "check_float32_states",
    "check_state_bits",
    "dequantize_blockwise",
    "lowbit_fields",
    "lowbit_kernel",
    "lowbit_new",
    "lowbit_options",
    "quantize_blockwise",
]
