"""Small calls the way users make them: numkv's decode on 1 thread against
all, back to back and after a gap of other work on the caller, beside a busy
Python thread, and the pool's launch; the idle CPU the workers burn.

    python tools/small_calls.py                  # every table
    python tools/small_calls.py --calls 400 --only threads

Each figure is the median of single calls' times; the compared settings
alternate run by run (20 calls; a slow spell of a shared machine falls on
all alike).  "after a gap": the caller spins ``--gap-ms`` in Python before each
call (a model's other work between two attention calls).
"""

import argparse
import statistics
import threading
import time

import numpy as np

import numkv
from numkv._runtime import pool

CASES = [  # (Hq, Hkv, D, Skv): the small decodes
    (32, 8, 128, 1024),
    (32, 8, 64, 2048),  # Llama-3.2-1B's heads
    (16, 4, 64, 1088),
    (32, 8, 128, 256),
]


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def interleaved(fns, calls, gap, run=20):
    """Median seconds of single calls of each of ``fns``, in runs of ``run``
    calls, the ``fns`` alternating run by run (the first call of a run not
    timed: a model calls with one setting, not a new one each call).  After
    a gap: each call after ``gap`` seconds of spinning."""
    times = [[] for _ in fns]
    for _ in range(max(1, calls // run)):
        for fn, out in zip(fns, times):
            spin(gap)
            fn()
            for _ in range(run):
                spin(gap)
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def on_threads(n, fn):
    def call():
        numkv.set_num_threads(n)
        fn()
    return call


def decode_call(hq, hkv, d, skv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, hq, 1, d), np.float32)
    k, v = (rng.standard_normal((1, hkv, skv, d), np.float32) for _ in range(2))
    return lambda: numkv.attention(q, k, v)


def threads_table(calls, gap_ms, threads):
    print(f"decode, {threads} threads over 1 (median of {calls} single calls each, interleaved)")
    print(f"{'case':28} {'1 thread':>10} {f'{threads} threads':>10} {'speed-up':>9} "
          f"{'1 (gap)':>10} {f'{threads} (gap)':>10} {'speed-up':>9}")
    for hq, hkv, d, skv in CASES:
        fn = decode_call(hq, hkv, d, skv)
        fn()
        row = []
        for gap in (0.0, gap_ms / 1e3):
            one, many = interleaved([on_threads(1, fn), on_threads(threads, fn)], calls, gap)
            row += [one, many, one / many]
        print(f"Hq{hq}-Hkv{hkv}-D{d}-Skv{skv:<6} {row[0] * 1e6:8.1f}us {row[1] * 1e6:8.1f}us {row[2]:8.2f}x "
              f"{row[3] * 1e6:8.1f}us {row[4] * 1e6:8.1f}us {row[5]:8.2f}x", flush=True)
    numkv.set_num_threads(None)


def busy_table(calls, threads):
    print(f"\nbeside a busy Python thread (a pure-Python loop), {threads} threads")
    fn = decode_call(32, 8, 128, 1024)
    numkv.set_num_threads(threads)
    fn()
    alone = interleaved([fn], calls, 0.0)[0]
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            x += 1

    other = threading.Thread(target=busy)
    other.start()
    try:
        beside = interleaved([fn], calls, 0.0)[0]
    finally:
        stop.set()
        other.join()
    print(f"decode Skv=1024: alone {alone * 1e6:.1f} us, beside {beside * 1e6:.1f} us: {beside / alone:.2f}x")
    numkv.set_num_threads(None)


def launch_table(calls, gap_ms, threads):
    from numkv._runtime import protocol

    print(f"\nlaunch: an empty kernel on {threads} threads (median of {calls} calls)")
    numkv.set_num_threads(threads)
    fn = lambda: pool.run(protocol.empty, threads, ())  # noqa: E731
    fn()
    back, = interleaved([fn], calls, 0.0)
    gap, = interleaved([fn], max(500, calls // 10), gap_ms / 1e3)
    print(f"back to back {back * 1e6:.2f} us, after a {gap_ms} ms gap {gap * 1e6:.2f} us")
    numkv.set_num_threads(None)


def torch_table(calls, threads):
    """A torch matmul on every thread alternating with numkv decodes, in one
    process: each one's median alone and alternating."""
    import torch

    print(f"\nbeside torch: a matmul on {threads} torch threads alternating with numkv decodes on {threads}")
    torch.set_num_threads(threads)
    numkv.set_num_threads(threads)
    a = torch.randn(384, 384)
    matmul = lambda: torch.mm(a, a)  # noqa: E731
    decode = decode_call(32, 8, 128, 1024)
    matmul(), decode()

    def median_of(fn, between=None):
        times = []
        for _ in range(calls):
            if between is not None:
                between()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    alone_mm, alone_dec = median_of(matmul), median_of(decode)
    mixed_mm, mixed_dec = median_of(matmul, decode), median_of(decode, matmul)
    print(f"torch matmul: alone {alone_mm * 1e6:.1f} us, after a numkv decode {mixed_mm * 1e6:.1f} us "
          f"({mixed_mm / alone_mm:.2f}x)")
    print(f"numkv decode Skv=1024: alone {alone_dec * 1e6:.1f} us, after a torch matmul {mixed_dec * 1e6:.1f} us "
          f"({mixed_dec / alone_dec:.2f}x)")
    numkv.set_num_threads(None)


def idle_table(threads):
    """CPU seconds the process burns per second of wall time: while idle
    after a burst of calls, and in a loop of calls with 1 ms gaps."""
    import resource

    def cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    print(f"\nidle CPU, {threads} threads (CPU-seconds per wall second)")
    numkv.set_num_threads(threads)
    fn = decode_call(32, 8, 128, 1024)
    for _ in range(2000):
        fn()
    c0, t0 = cpu(), time.perf_counter()
    time.sleep(1.0)
    print(f"idle second right after 2000 calls: {(cpu() - c0) / (time.perf_counter() - t0):.3f}")
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(500):
        fn()
        time.sleep(1e-3)
    busy = (cpu() - c0) / (time.perf_counter() - t0)
    print(f"calls with 1 ms sleeps between (the caller idle): {busy:.3f}")
    numkv.set_num_threads(None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=numkv.get_num_threads())
    parser.add_argument("--only", choices=("threads", "busy", "launch", "torch", "idle"))
    args = parser.parse_args()
    if args.only in (None, "threads"):
        threads_table(args.calls, args.gap_ms, args.threads)
    if args.only in (None, "busy"):
        busy_table(min(args.calls, 500), args.threads)
    if args.only in (None, "launch"):
        launch_table(max(5000, args.calls), args.gap_ms, args.threads)
    if args.only in (None, "torch"):
        torch_table(min(args.calls, 1000), args.threads)
    if args.only in (None, "idle"):
        idle_table(args.threads)


if __name__ == "__main__":
    main()
