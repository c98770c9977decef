"""The machine limits behind the bench's "% of limit" column, measured at the
start of each run (on a shared machine they move with the load, like the cases).

* **GEMM rate**: ``np.dot`` of two 2048 x 2048 float32 matrices (NumPy's BLAS,
  with its own thread count or ``--threads``), ``2 n^3`` FLOPs per product,
  median of a few products after a warm-up one.  It stands for what the
  machine's vector units reach on well-blocked arithmetic; a prefill's FLOPs
  per second is quoted against it, whatever its dtype (float32 is the rate the
  kernels accumulate at).
* **Read bandwidth**: a parallel sum (numba ``prange``, every numba thread:
  the runtime numkv's kernels run on) over a float32 array of 512 MiB, far
  beyond any cache; bytes read per second, median of a few passes after a
  warm-up one (which also compiles the sum).  A decode step's bytes per second
  are quoted against it.  A sum reads and barely computes, so it is the most a
  kernel that reads K and V once can hope for.

Units are decimal: 1 GFLOP/s = 1e9 FLOP/s, 1 GB/s = 1e9 bytes/s.
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np
from numba import prange

from ._config import jit


@dataclass(frozen=True)
class MachineLimits:
    gemm_flops: float     # FLOP/s of the float32 GEMM
    read_bytes: float     # bytes/s of the parallel read
    gemm_n: int
    read_nbytes: int

    def per_second(self, limit):
        """The rate a "gemm" or "read" case is quoted against."""
        return {"gemm": self.gemm_flops, "read": self.read_bytes}[limit]

    def describe(self):
        return (f"fp32 GEMM {self.gemm_flops / 1e9:.1f} GFLOP/s ({self.gemm_n}^3 np.dot), "
                f"read bandwidth {self.read_bytes / 1e9:.1f} GB/s "
                f"(numba prange sum over {self.read_nbytes >> 20} MiB float32)")


def _median_seconds(fn, repeats):
    fn()  # warm-up (BLAS threads start, the sum compiles, pages fault in)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rate(n=2048, repeats=5):
    """FLOP/s of a float32 ``n x n x n`` ``np.dot``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    return 2.0 * n ** 3 / _median_seconds(lambda: np.dot(a, b, out=c), repeats)


LANES = 64  # independent float32 accumulators per chunk


@jit(parallel=True, reassociate=True)
def _chunk_sums(rows, out):
    """``out[c]`` = the sum of the ``c``-th of ``len(out)`` equal chunks of the
    ``(n, LANES)`` array ``rows``.  One running sum per column: a single scalar
    accumulator does not vectorise, and the sum then runs at a quarter of
    NumPy's single-threaded ``a.sum()`` (measured: 5.7 vs 22.8 GB/s on 2 cores)."""
    chunks = out.shape[0]
    step = (rows.shape[0] + chunks - 1) // chunks
    for c in prange(chunks):
        acc = np.zeros(rows.shape[1], np.float32)
        for r in range(c * step, min(rows.shape[0], (c + 1) * step)):
            for j in range(rows.shape[1]):
                acc[j] += rows[r, j]
        out[c] = acc.sum()


def read_bandwidth(nbytes=512 << 20, repeats=5):
    """Bytes/s of a parallel sum over a float32 array of ``nbytes``."""
    rows = np.ones((nbytes // (4 * LANES), LANES), np.float32)  # written once: every page faulted in
    partial = np.empty(256, np.float32)  # many chunks per thread: no thread idles at the end
    return rows.nbytes / _median_seconds(lambda: _chunk_sums(rows, partial), repeats)


def measure_limits(gemm_n=2048, read_nbytes=512 << 20, repeats=5):
    return MachineLimits(gemm_rate(gemm_n, repeats), read_bandwidth(read_nbytes, repeats), gemm_n, read_nbytes)
