"""A read-bandwidth probe for the bench: sums of chunks of a large array.

``rows`` is ``(n, LANES)`` float32; item ``c`` of ``n_items`` sums the
``c``-th equal share of its rows into ``out[c]``.  Run over numkv's threads
(``numkv._runtime.pool``), as the attention kernels are, so the bench quotes a
decode step against what the same threads can read.
"""

import numpy as np

from .._config import jit
from .._runtime.protocol import pool_enter, pool_exit

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "d94eb70804b94aea36fd47857741d29335cf05a0cf89a8d3f004ae080d3bfccc"

LANES = 64  # independent float32 accumulators per chunk


@jit(reassociate=True)
def chunk_sums(first, stop, rows, out, ctrl, role):
    """``out[c]`` for ``c`` in ``first .. stop``.  One running sum per column:
    a single scalar accumulator does not vectorise, and the sum then runs at a
    quarter of NumPy's single-threaded ``a.sum()`` (measured: 5.7 vs 22.8 GB/s
    on 2 cores)."""
    if not pool_enter(ctrl, role):
        return
    chunks = out.shape[0]
    step = (rows.shape[0] + chunks - 1) // chunks
    acc = np.empty(rows.shape[1], np.float32)
    for c in range(first, stop):
        acc[:] = 0.0
        for r in range(c * step, min(rows.shape[0], (c + 1) * step)):
            for j in range(rows.shape[1]):
                acc[j] += rows[r, j]
        out[c] = acc.sum()
    pool_exit(ctrl, role)
