"""Spin-waiting for numkv's thread pool: a short wait on a flag, without the GIL.

Waking a sleeping thread costs ~50 us on a virtual machine (measured: an
empty job handed to a pool worker came back in 115 us when the caller slept
until it was done, 27 us when the caller spun), so a caller that expects its
workers to finish soon spins first, with the CPU's pause hint, then sleeps.
"""

from .._config import jit
from .simd import _load_acquire, _pause

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "9465287aa0fb46b518d83f0d4cf53583119a7f179e348865a4d813a6d8dc7a8e"


@jit()
def wait_at_least(flags, index, value, spins):
    """Whether ``flags[index] >= value`` within ``spins`` polls (~30 ns each)."""
    for _ in range(spins):
        if _load_acquire(flags, index) >= value:
            return True
        _pause()
    return False
