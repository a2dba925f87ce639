"""Low-bit optimizer states: a fused optimizer's moments as 8-bit block-wise codes.

* ``codes.py``: the 8-bit codes (Note [block-wise codes], Note [dithered rounding]).
* ``blockwise.py``: block-wise quantization with torch ops.
"""

from .blockwise import block_count, dequantize_blockwise, quantize_blockwise
from .codes import SIGNED, UNSIGNED, Code

__all__ = [
    "SIGNED",
    "UNSIGNED",
    "Code",
    "block_count",
    "dequantize_blockwise",
    "quantize_blockwise",
]
