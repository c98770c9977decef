"""numkv's thread pool: what handing a kernel to the threads costs, and a
small decode the way a model calls it (after other work on the caller).

``time_launch``: an empty kernel on every thread (``_runtime.protocol.empty``),
back to back.  The ``track_*`` benchmarks time single calls each after
``GAP`` seconds of other work (a spin) on the caller and report the median
in microseconds: asv's own loop would time the calls back to back, with the
workers awake and the caches warm.
"""

import statistics
import timeit

import numpy as np

from ._common import SEED, numkv_attention

GAP = 1e-3
CALLS = 2000


def _spin(seconds):
    end = timeit.default_timer() + seconds
    while timeit.default_timer() < end:
        pass


def _median_after_gap_us(fn, calls=CALLS, gap=GAP):
    times = []
    for _ in range(calls):
        _spin(gap)
        start = timeit.default_timer()
        fn()
        times.append(timeit.default_timer() - start)
    return statistics.median(times) * 1e6


class Launch:
    timer = timeit.default_timer

    def setup(self):
        from numkv._runtime import pool, protocol, thread_count

        threads = thread_count.get_num_threads()
        self.launch = lambda: pool.run(protocol.empty, threads, ())
        self.launch()

    def time_launch(self):
        self.launch()

    def track_launch_after_gap(self):
        return _median_after_gap_us(self.launch)

    track_launch_after_gap.unit = "us"


class SmallDecodeAfterGap:
    """Decode B=1 of the small shapes whose threads cost the most: Hq=32
    Hkv=8 D=128 over 1024 keys, Llama-3.2-1B's heads over 2048, Hq=16 Hkv=4
    D=64 over 1088."""

    params = [["Hq32-Hkv8-D128-Skv1024", "Hq32-Hkv8-D64-Skv2048", "Hq16-Hkv4-D64-Skv1088"]]
    param_names = ["case"]
    timer = timeit.default_timer

    def setup(self, case):
        hq, hkv, d, skv = (int(part.lstrip("HqkvDS")) for part in case.split("-"))
        rng = np.random.default_rng(SEED)
        q = rng.standard_normal((1, hq, 1, d), dtype=np.float32)
        k, v = (rng.standard_normal((1, hkv, skv, d), dtype=np.float32) for _ in range(2))
        attention = numkv_attention()
        self.call = lambda: attention(q, k, v)
        self.call()

    def track_after_gap(self, case):
        return _median_after_gap_us(self.call, calls=500)

    track_after_gap.unit = "us"
