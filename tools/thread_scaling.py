"""Decode time against numkv's thread count, beside torch's packed-GQA SDPA on 16
threads, and the pool's launch of an empty kernel: `python tools/thread_scaling.py`
(needs torch)."""

import statistics
import time

import numpy as np

import numkv
from numkv._runtime import pool

def med(fn, n=200, min_s=0.3):
    fn(); ts = []
    end = time.perf_counter() + min_s
    while len(ts) < n or time.perf_counter() < end:
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        if len(ts) > 5000: break
    return statistics.median(ts)

rng = np.random.default_rng(0)
cases = [(32, 8, 128, 1024), (32, 8, 64, 2048), (16, 4, 64, 1088), (32, 8, 128, 4096), (32, 8, 128, 16384)]
counts = [1, 2, 4, 8, 16]
print("case", *[f"t{c}" for c in counts], "torch16", sep="\t")
import torch
for hq, hkv, d, skv in cases:
    q = rng.standard_normal((1, hq, 1, d), np.float32)
    k = rng.standard_normal((1, hkv, skv, d), np.float32); v = rng.standard_normal((1, hkv, skv, d), np.float32)
    row = []
    for c in counts:
        numkv.set_num_threads(c)
        row.append(med(lambda: numkv.attention(q, k, v)) * 1e6)
    torch.set_num_threads(16)
    tq = torch.from_numpy(q).reshape(1, hkv, hq // hkv, d); tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    tt = med(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)) * 1e6
    print(f"Hq{hq}-Hkv{hkv}-D{d}-Skv{skv}", *[f"{x:.0f}" for x in row], f"{tt:.0f}", sep="\t", flush=True)
numkv.set_num_threads(None)
# the pool's launch: a kernel doing nothing, on c threads
from numkv._runtime import protocol
print("pool launch (us):", end=" ")
for c in counts:
    numkv.set_num_threads(c)
    print(f"t{c}={med(lambda: pool.run(protocol.empty, c, ())) * 1e6:.1f}", end=" ", flush=True)
print()
