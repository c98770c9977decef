"""float32 -> float16, for a float16 Y: the CPU's F16C conversion
(``vcvtps2ph``, eight at a time), round to nearest even as NumPy's ``astype``
(which converts one element at a time in software here: 5 ns an element,
11 ms of a 40 ms float16 causal prefill at S=512; this: ~0.1 ns).
"""

import numpy as np

from .._config import jit
from .._runtime.protocol import pool_enter, pool_exit
from .cpu import has_f16c  # noqa: F401  (the wrapper asks here: ``to_float16`` is for F16C)
from .simd import _full_width_loops, _half_bits

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "71f45da9baac354f77a4acd4f276981b8b9c5dae211f058be67d12aa6e00ca69"

CHUNK = 1 << 16  # elements a work item


@jit()
def to_float16(first, stop, src, dst, ctrl, role):
    """``dst = float16 bits of src`` (both flat), chunks ``first .. stop``
    (``ctrl`` and ``role``: the pool's, ``_runtime.protocol``)."""
    _full_width_loops()
    if not pool_enter(ctrl, role):
        return
    for c in range(first, stop):
        for i in range(np.uint64(c * CHUNK), np.uint64(min(src.size, (c + 1) * CHUNK))):
            dst[i] = _half_bits(src[i])
    pool_exit(ctrl, role)
