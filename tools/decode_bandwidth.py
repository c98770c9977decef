"""A float32 decode's share of the read bandwidth, measured in pairs.

    python tools/decode_bandwidth.py            # six pairs
    python tools/decode_bandwidth.py --pairs 10

On a shared host the read bandwidth moves from one measurement to the next
(23-46 GB/s here within minutes), so the bench's one figure per run can make
the decode % column read high or low.  Here each pair measures the bandwidth
(the bench's parallel sum over 512 MiB) and right after times 15 decode calls
(B=1, Hq=32, Hkv=8, D=128, Skv=16384, float32: 134 MB of K and V a call).
"""

import argparse
import time

import numpy as np

import numkv
from numkv._cli.bench_limits import read_bandwidth


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, 1, 128), np.float32)
    k, v = (rng.standard_normal((1, 8, 16384, 128), np.float32) for _ in range(2))
    numkv.attention(q, k, v)  # compiles
    nbytes = k.nbytes + v.nbytes
    for _ in range(args.pairs):
        bandwidth = read_bandwidth()
        times = []
        for _ in range(15):
            start = time.perf_counter()
            numkv.attention(q, k, v)
            times.append(time.perf_counter() - start)
        t = float(np.median(times))
        print(f"read {bandwidth / 1e9:5.1f} GB/s   decode {t * 1e3:5.2f} ms = {nbytes / t / 1e9:5.1f} GB/s"
              f" = {100 * nbytes / t / bandwidth:3.0f}% of it")


if __name__ == "__main__":
    main()
