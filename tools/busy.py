"""A decode step on a busy machine: its time beside CPU-bound processes.

    python tools/busy.py              # beside two busy Python loops
    python tools/busy.py --hogs 3

Times a decode step (B=1, Hq=32, Hkv=8, D=128, Skv=4096, float32) and a small
call (Hq=8, Skv=512: below numkv's one-thread threshold), quiet, then beside
``--hogs`` processes spinning in Python, then quiet again; prints medians and
the 90th percentile, and the busy median over the mean quiet one (a fair
share on 2 cores beside two hogs is ~3x).
"""

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

import numkv


def sample(fn, calls, pause=0.002):
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        time.sleep(pause)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside numkv (default 2)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, 1, 128), np.float32)
    k, v = (rng.standard_normal((1, 8, 4096, 128), np.float32) for _ in range(2))
    q_small, k_small = rng.standard_normal((1, 8, 1, 128), np.float32), rng.standard_normal((1, 8, 512, 128),
                                                                                             np.float32)
    decode, small = (lambda: numkv.attention(q, k, v)), (lambda: numkv.attention(q_small, k_small, k_small))
    decode(), small()

    def report(label):
        (median, p90), (small_median, small_p90) = sample(decode, 40), sample(small, 200)
        print(f"{label:24} decode step: median {median * 1e3:6.2f} ms, p90 {p90 * 1e3:6.2f} ms;  "
              f"small call: median {small_median * 1e3:5.2f} ms, p90 {small_p90 * 1e3:5.2f} ms", flush=True)
        return median

    quiet = report("quiet")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        time.sleep(0.5)
        busy = report(f"beside {args.hogs} busy loops")
    finally:
        for hog in hogs:
            hog.kill()
    time.sleep(0.5)
    quiet = (quiet + report("quiet again")) / 2
    print(f"decode step busy / quiet: {busy / quiet:.2f}x")


if __name__ == "__main__":
    main()
