"""Prefill's tile products alone (``numkv._kernels.gemm``'s register
blocks), one thread, by how far apart their right operand's rows lie:
``S = Q K^T`` with K^T's rows ``ldt`` elements apart, and ``acc += P V``
with V's rows ``vld`` apart.  256 rows x 512 keys x 128, float32.

    python tools/tile_products.py

Rows a power of two of bytes apart put a block's column vectors, one from
each row, in few of the L1's sets (2 KiB: 2 of 64 sets; 4 KiB: one): the
reason K^T's rows lie an odd number of lines apart (``gemm._kt_stride``) and the products copy a
token-major V into the tile (``loop_functions.read_in_place``).
"""

import statistics
import time

import numba
import numpy as np

from numkv._kernels.gemm import BLOCK_ROWS, _block_add, _block_columns, _block_set
from numkv._kernels.simd import _min

ROWS, KEYS, D = 256, 512, 128


@numba.njit
def scores(q, kt, ldt, s, reps):
    columns = _block_columns(kt)
    for _ in range(reps):
        for j in range(0, KEYS, columns):
            for i in range(0, ROWS, BLOCK_ROWS):
                _block_set(s, i * KEYS + j, KEYS, q, i * D, D, kt, j, ldt, D, _min(BLOCK_ROWS, ROWS - i),
                           _min(columns, KEYS - j))


@numba.njit
def values(p, v, vld, acc, reps):
    columns = _block_columns(v)
    for _ in range(reps):
        for i in range(0, ROWS, BLOCK_ROWS):
            for j in range(0, D, columns):
                _block_add(acc, i * D + j, D, p, i * KEYS, KEYS, v, j, vld, KEYS, _min(BLOCK_ROWS, ROWS - i),
                           _min(columns, D - j))


def median_us(fn, reps=20, runs=7):
    fn(1)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(reps)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times) * 1e6


def main():
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    flops = 2 * ROWS * KEYS * D
    q, s = rng.standard_normal(ROWS * D, dtype=np.float32), np.zeros(ROWS * KEYS, np.float32)
    for ldt in (KEYS, KEYS + 16, KEYS + 64):
        kt = rng.standard_normal(D * ldt, dtype=np.float32)
        us = median_us(lambda reps: scores(q, kt, ldt, s, reps))
        print(f"S = Q K^T, K^T's rows {ldt:5d} apart: {us:7.1f} us  {flops / us / 1e3:5.1f} GFLOP/s")
    p, acc = rng.standard_normal(ROWS * KEYS, dtype=np.float32), np.zeros(ROWS * D, np.float32)
    for vld in (D, D + 16, 4 * D, 8 * D, 8 * D + 16):
        v = rng.standard_normal(KEYS * vld, dtype=np.float32)
        us = median_us(lambda reps: values(p, v, vld, acc, reps))
        print(f"acc += P V, V's rows {vld:5d} apart: {us:7.1f} us  {flops / us / 1e3:5.1f} GFLOP/s")


if __name__ == "__main__":
    main()
