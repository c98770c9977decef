"""Causal prefill (B=1, Hq=32, Hkv=8, D=128, S=2048) on numkv's two product
paths, interleaved: whole tiles in numkv's own single-threaded OpenBLAS (the
default) against products split to OpenBLAS' single-thread size (what a
multi-threaded BLAS gets).  Medians of 7 calls each:

    python tools/prefill_paths.py
"""

import time

import numpy as np

import numkv
from numkv._runtime import blas as numkv_blas


def main(seq=2048, repeats=7):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, seq, 128), np.float32)
    k = rng.standard_normal((1, 8, seq, 128), np.float32) * np.float32(128 ** -0.25)
    v = rng.standard_normal((1, 8, seq, 128), np.float32)
    whole = numkv_blas.single_threaded
    paths = {"whole tiles (numkv's BLAS)": whole, "split products": lambda: False}
    times = {name: [] for name in paths}
    try:
        for rep in range(repeats + 1):  # the first round compiles and warms up
            for name, single_threaded in paths.items():
                numkv_blas.single_threaded = single_threaded
                time.sleep(0.15)
                start = time.perf_counter()
                numkv.attention(q, k, v, is_causal=True)
                if rep:
                    times[name].append(time.perf_counter() - start)
    finally:
        numkv_blas.single_threaded = whole
    for name, samples in times.items():
        print(f"{name}: {np.median(samples) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
