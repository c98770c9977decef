"""The machine limits behind the bench's "% of limit" column, measured at the
start of each run (on a shared machine they move with the load, like the cases).

* **GEMM rate**: ``np.dot`` of two 2048 x 2048 float32 matrices (NumPy's BLAS,
  with its own thread count or ``--threads``), ``2 n^3`` FLOPs per product,
  median of a few products after a warm-up one.  It stands for what the
  machine's vector units reach on well-blocked arithmetic; a prefill's FLOPs
  per second is quoted against it, whatever its dtype (float32 is the rate the
  kernels accumulate at).
* **Read bandwidth**: a parallel sum (on numkv's threads, as its kernels
  run) over a float32 array of 512 MiB, far
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

from numkv._runtime import pool


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
                f"(a sum over {self.read_nbytes >> 20} MiB float32 on numkv's threads)")


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


def read_bandwidth(nbytes=512 << 20, repeats=5):
    """Bytes/s of a parallel sum over a float32 array of ``nbytes``."""
    from numkv._kernels.read_bandwidth import LANES, chunk_sums

    rows = np.ones((nbytes // (4 * LANES), LANES), np.float32)  # written once: every page faulted in
    partial = np.empty(256, np.float32)  # many chunks per thread: no thread idles at the end
    return rows.nbytes / _median_seconds(
        lambda: pool.run(chunk_sums, len(partial), (rows, partial), release_gil=True), repeats)


def measure_limits(gemm_n=2048, read_nbytes=512 << 20, repeats=5):
    return MachineLimits(gemm_rate(gemm_n, repeats), read_bandwidth(read_nbytes, repeats), gemm_n, read_nbytes)
