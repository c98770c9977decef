"""Why a decode over token-major keys (transformers' read-out, paged caches:
``(T, Hkv, D)``) is slower than over head-major ones, and which read order
would mend it: a dot product of each kv head's query with each of its keys,
one thread, keys from memory (a 64 MiB write evicts them before each call),
in the orders a kernel could take.

    python tools/token_major_reads.py            # 16,384 keys, 4 kv heads of 64
    python tools/token_major_reads.py --keys 4096 --heads 8 --head-size 128

Rows: ``head-major``, the keys of a head contiguous (numkv.attention's
``(B, Hkv, S, D)``); ``per head``, one head's keys after another over each
sequence of ``--sequence`` keys, prefetching its own rows ahead (what the
kernel does today: an item a kv head); ``heads by T keys``, every head's T
keys in turn, each prefetching its own rows T keys ahead; ``row``, every
head of a key row before the next row.
"""

import argparse
import statistics
import time

import numpy as np
from numba import njit

from numkv._kernels.simd import _prefetch

LINE = 16  # float32 elements a cache line


@njit(fastmath=True, boundscheck=False)
def head_major(k, q, out):
    heads, keys, d = k.shape
    for h in range(heads):
        for j in range(keys):
            s = 0.0
            for i in range(d):
                s += k[h, j, i] * q[h, i]
            out[h, j] = s


@njit(fastmath=True, boundscheck=False)
def heads_by_tiles(k, q, out, tile, sequence):
    """Per ``sequence`` keys: every head's ``tile`` keys in turn, each key
    asking for its own row ``tile`` keys on (``tile == sequence``: one head's
    keys after another)."""
    keys, heads, d = k.shape
    flat, row = k.reshape(-1), heads * d
    for s0 in range(0, keys, sequence):
        s1 = min(s0 + sequence, keys)
        for j0 in range(s0, s1, tile):
            for h in range(heads):
                for j in range(j0, min(j0 + tile, s1)):
                    ahead = (j + min(tile, 16)) * row + h * d
                    for i in range(0, d, LINE):
                        _prefetch(flat, ahead + i)
                    s = 0.0
                    for i in range(d):
                        s += k[j, h, i] * q[h, i]
                    out[h, j] = s


@njit(fastmath=True, boundscheck=False)
def row_order(k, q, out):
    keys, heads, d = k.shape
    for j in range(keys):
        for h in range(heads):
            s = 0.0
            for i in range(d):
                s += k[j, h, i] * q[h, i]
            out[h, j] = s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--sequence", type=int, default=2048, help="keys a sequence (an item's range)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((args.keys + 64, args.heads, args.head_size), dtype=np.float32)[:args.keys]
    k_hm = np.ascontiguousarray(k.transpose(1, 0, 2))
    q = rng.standard_normal((args.heads, args.head_size), dtype=np.float32)
    out = np.empty((args.heads, args.keys), np.float32)
    seq = args.sequence
    orders = {
        "head-major": lambda: head_major(k_hm, q, out),
        "per head (an item a kv head)": lambda: heads_by_tiles(k, q, out, seq, seq),
        "heads by 64 keys": lambda: heads_by_tiles(k, q, out, 64, seq),
        "heads by 16 keys": lambda: heads_by_tiles(k, q, out, 16, seq),
        "row": lambda: row_order(k, q, out),
    }
    evict = np.empty(64 << 20, np.uint8)
    for fn in orders.values():
        fn()
    times = {name: [] for name in orders}
    for _ in range(args.repeats):
        for name, fn in orders.items():
            evict[:] = 1
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"# {args.keys} keys x {args.heads} kv heads of {args.head_size} float32 ({k.nbytes / 2**20:.0f} MiB), "
          f"sequences of {seq}, 1 thread, medians of {args.repeats} (orders alternating)")
    base = statistics.median(times["head-major"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:30s} {t * 1e3:7.2f} ms {k.nbytes / t / 1e9:6.1f} GB/s {t / base:6.2f}x head-major's time")


if __name__ == "__main__":
    main()
