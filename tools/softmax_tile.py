"""The online softmax of one prefill tile on one core, alone.

    python tools/softmax_tile.py              # a 256 x 512 tile (the default tile's shape)
    python tools/softmax_tile.py 256 256

Calls the tile softmax that the matrix products' tiles take (the C function
``loop_functions`` compiles for ``GEMM_SOFTMAX``, float32) through ctypes on a
tile of random scores that is in cache, every row attending every key, and
prints the median of 200 calls, less that of a call with no rows (the
ctypes call itself, ~1 us), and its cost per score.  What the whole call
spends besides its two products, measured without them.
"""

import ctypes
import sys
import time

import numpy as np

from numkv._kernels import loop_functions
from numkv._kernels.layout import F32, GEMM_SOFTMAX


def main(rows=256, n=512, calls=200):
    function = loop_functions._compile(0, F32, GEMM_SOFTMAX)
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    softmax = ctypes.CFUNCTYPE(i, p, i, p, i, p, i, p, i, p, i, p, i, p, i, p, i, *[i] * 9, f, f)(function.address)
    scores = (np.random.default_rng(0).standard_normal((rows, n)) * 3).astype(np.float32)
    s = scores.copy()
    lo, hi = np.zeros(rows, np.int64), np.full(rows, n - 1, np.int64)
    mask = np.zeros(1, np.float32)
    m, l, alpha = (np.empty(rows, np.float32) for _ in range(3))
    bad = np.zeros(rows, np.uint8)
    # The arguments made once: each ``.ctypes.data`` costs ~1 us, and the
    # call's ~9 us of them were timed with the tile until 2026-11-27.
    args = (s.ctypes.data, s.size, lo.ctypes.data, rows, hi.ctypes.data, rows, mask.ctypes.data, 1,
            m.ctypes.data, rows, l.ctypes.data, rows, alpha.ctypes.data, rows, bad.ctypes.data, rows,
            rows, n, rows, 0, 0, -1, 0, 0, 0, 0.0, 1.0)  # rows, keys, queries, j0, edge, no mask, ...
    empty = args[:16] + (0,) + args[17:]  # no rows: what the call itself costs
    times, overhead = [], []
    for _ in range(calls):
        np.copyto(s, scores)
        m.fill(-np.inf)
        l.fill(0.0)
        start = time.perf_counter()
        softmax(*args)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        softmax(*empty)
        overhead.append(time.perf_counter() - start)
    median = sorted(times)[calls // 2] - sorted(overhead)[calls // 2]
    assert np.allclose(l, np.exp(scores - scores.max(axis=1, keepdims=True)).sum(axis=1), rtol=1e-5)
    print(f"{rows} x {n} tile: {median * 1e6:.1f} us, {median * 1e9 / (rows * n):.3f} ns a score")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
