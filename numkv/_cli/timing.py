"""How ``python -m numkv bench`` times and reports: numkv beside its peers and the machine's limits.

Times the public API (``numkv.attention``, ``numkv.tensor_scatter``) on fixed
cases (``numkv._cli.bench_cases``: the workloads, their FLOPs and bytes, the
peers) beside onnxruntime, torch, ``onnx.reference`` (the executable ONNX
spec) and NumPy, whichever are installed.

Method
------
* Every figure is the **median** time per call over repeated samples.  The
  first call of each implementation (numba's compilation, onnxruntime's
  session warm-up) is made before timing and its output kept for the
  ``max|dY|`` check against numkv's Y.
* The implementations of a case are **sampled in turn**, one sample of each
  per round, so a slow spell of a shared machine falls on all of them alike:
  the ratios hold better than the times.  A sample runs its call often enough
  to last 0.1 s (``MIN_SAMPLE``); a slow call gets fewer samples (``budget``
  seconds each), never fewer than the case's minimum (5 for the attention
  cases, 3 with ``--quick``).
* **ratio** = the implementation's time / numkv's (above 1: slower than numkv).
* **rate** and **% of limit**: the machine limits are measured at the start of
  the run (``numkv._cli.bench_limits``: an fp32 GEMM rate and a parallel read
  bandwidth).  A prefill line quotes its FLOPs per second (exact FLOPs: for each
  query row, the keys it attends x 2 x (D + Dv) x heads) as a % of the GEMM
  rate; a decode line the bytes it must move (the attended K and V rows, read
  once, plus Q and Y, in the dtypes that implementation is given) per second as
  a % of the read bandwidth.  Peers get the same formula for the same work.
  Above 100 %: a peer's own GEMM (MKL, MLAS) beats NumPy's BLAS, K/V partly
  sat in cache, or the limit was measured in a slow spell of a shared machine.
* The run ends with a summary: per case, numkv's time, the fastest other
  implementation and its time, their ratio and both % of limit.

``--only REGEX`` runs the cases whose id or title matches (``--list`` shows
them); ``--plot FILE.png`` runs the sweep of ``numkv._cli.plot`` instead.
This is a quick side-by-side; the asv suite (``asv_benchmarks/``) is the
tracked, parameterised one.
"""

import importlib.util
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import numkv
from numkv._cli.info import runtime_info

LABEL_WIDTH = 54


# -- timing -------------------------------------------------------------------

SETTLE = 0.15  # seconds of pause before a sample of another implementation
# Seconds a sample lasts at least.  After the pause the cores are slow for a
# while (a halted virtual CPU wakes late, caches went cold): 20 ms samples
# timed that wake-up (2 cores, decode Skv=16384 float32: numkv 12.1-13.1 ms,
# onnxruntime 22-25 ms) rather than the steady calls of a decode loop that
# 0.1 s samples time (numkv 8.2-8.3 ms, onnxruntime 17-19 ms).
MIN_SAMPLE = 0.1


def measure(fns, repeats, min_sample=None, budget=10.0, min_samples=3, warm_up=True, settle=None):
    """Median seconds per call of each of ``fns``, over ``repeats`` samples each;
    a sample runs its ``fn`` enough times to last ``min_sample`` seconds
    (default ``MIN_SAMPLE``), and a slow ``fn`` (one call longer than
    ``budget / repeats``) gets fewer samples, at least ``min_samples``.  The
    samples are taken in turn, one of each ``fn`` per round, so a slow spell
    of a shared machine falls on every implementation alike.  ``warm_up``:
    make each ``fn``'s first (compiling) call here; pass False when the
    caller already did.

    Each sample starts after a pause of ``settle`` seconds (default
    ``SETTLE``): after a call, the
    worker threads of OpenBLAS (up to 2**28 cycles, ~0.1 s), GNU OpenMP and
    onnxruntime keep spinning, and on a small machine they would slow
    whichever implementation is sampled next (measured on 2 cores: numkv's
    causal prefill 416 ms right after NumPy's matmuls, 374 ms alone)."""
    min_sample = MIN_SAMPLE if min_sample is None else min_sample
    counts = []
    for fn in fns:
        if warm_up:
            fn()  # the first call compiles / warms up: never timed
        number = 1
        while True:  # size the samples (as timeit.Timer.autorange does)
            elapsed = _sample(fn, number) * number
            if elapsed >= min_sample:
                break
            number *= 10 if elapsed < min_sample / 10 else 2
        samples = max(min_samples, min(repeats, int(budget / max(elapsed, 1e-9))))
        counts.append((number, samples))
    samples = [[] for _ in fns]
    for round_ in range(max(n for _, n in counts)):
        for fn, (number, n), got in zip(fns, counts, samples):
            if round_ < n:
                if len(fns) > 1:
                    time.sleep(SETTLE if settle is None else settle)
                got.append(_sample(fn, number))
    return [statistics.median(got) for got in samples]


def measure_calls(fns, calls, gap):
    """Median seconds of ``calls`` single calls of each of ``fns``, taken in
    turn, each after ``gap`` seconds of work on this thread (a spin: a
    model's other work between two calls; 0: back to back)."""
    times = [[] for _ in fns]
    for _ in range(calls):
        for fn, got in zip(fns, times):
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
            start = time.perf_counter()
            fn()
            got.append(time.perf_counter() - start)
    return [statistics.median(got) for got in times]


def _sample(fn, number):
    """Seconds per call of ``fn`` over ``number`` calls."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


@dataclass
class Settings:
    repeats: int = 15
    budget: float = 10.0  # seconds of samples per implementation
    min_samples: int = 5  # for the attention cases (the scatter ones take 3)

    @classmethod
    def from_args(cls, args):
        return cls(3, 2.0, 3) if args.quick else cls()


@dataclass
class Timing:
    """An implementation's outcome: its time, or why it has none."""

    impl: object  # _bench_cases.Impl
    seconds: Optional[float] = None
    max_dy: Optional[float] = None
    note: str = ""

    def rate(self):
        """Work per second (FLOP/s or bytes/s), when both are known."""
        if self.seconds is None or self.impl.work is None:
            return None
        return self.impl.work / self.seconds


@dataclass
class CaseTiming:
    case: object  # _bench_cases.Case
    timings: list = field(default_factory=list)

    def numkv(self):
        first = self.timings[0] if self.timings else None
        return first if first is not None and first.impl.peer == "numkv" else None

    def best_peer(self):
        timed = [t for t in self.timings[1:] if t.seconds is not None]
        return min(timed, key=lambda t: t.seconds) if timed else None


def time_case(case, settings):
    """Build ``case``'s implementations, make each one's first call (a failure
    is noted, the rest go on), then time those that ran, in turn."""
    timings, outputs = [], []
    for impl in case.build():
        timing = Timing(impl, note=impl.note)
        timings.append(timing)
        if impl.fn is None:
            continue
        try:
            outputs.append((timing, impl.fn()))
        except Exception as e:  # a peer that can't run this case: say so, go on
            timing.note = f"failed: {type(e).__name__}: {str(e)[:120]}"
    ran = [t for t, _ in outputs]
    if ran and case.gap is not None:
        times = measure_calls([t.impl.fn for t in ran], case.calls, case.gap)
        for timing, seconds in zip(ran, times):
            timing.seconds = seconds
    elif ran:
        min_samples = max(3, min(case.min_samples, settings.min_samples))
        times = measure([t.impl.fn for t in ran], settings.repeats, budget=settings.budget,
                        min_samples=min_samples, warm_up=False)
        for timing, seconds in zip(ran, times):
            timing.seconds = seconds
    if case.check and outputs:
        _check_outputs(outputs)
    return CaseTiming(case, timings)


def _check_outputs(outputs):
    """``max|dY|`` of each output against the first one (numkv's), in float32."""
    expected = as_float32(outputs[0][1])
    for timing, y in outputs[1:]:
        try:
            timing.max_dy = float(np.max(np.abs(as_float32(y) - expected)))
        except Exception:  # an output we can't read as an array: no check, no crash
            timing.max_dy = None


def as_float32(y):
    """A NumPy float32 copy of Y from any implementation (torch tensors included)."""
    if hasattr(y, "detach"):  # torch: bfloat16 has no NumPy twin
        y = y.detach().float().numpy()
    return np.asarray(y).astype(np.float32)


# -- the report --------------------------------------------------------------------

def fmt_time(seconds):
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:8.2f} {unit:<2}"
    return f"{seconds / 1e-9:8.1f} ns"


def fmt_rate(rate, limit):
    if rate is None or limit is None:
        return ""
    return f"{rate / 1e9:7.1f} {'GFLOP/s' if limit == 'gemm' else 'GB/s':<7}"


def percent_of_limit(timing, limit, limits):
    rate = timing.rate()
    if rate is None or limit is None or limits is None:
        return None
    return 100.0 * rate / limits.per_second(limit)


def _fmt_percent(percent, limit):
    if percent is None:
        return ""
    return f"{percent:5.0f}% {'GEMM' if limit == 'gemm' else 'read'}"


def print_case(result, limits):
    """One line per implementation: time, ratio to numkv, rate, % of limit, max|dY|."""
    limit = result.case.limit
    base = result.timings[0].seconds if result.timings else None
    for timing in result.timings:
        label = timing.impl.label
        if timing.seconds is None:
            print(f"  {label:<{LABEL_WIDTH}} {timing.note}")
            continue
        ratio = f"{timing.seconds / base:7.2f}x" if base else "        "
        parts = [fmt_time(timing.seconds), ratio, fmt_rate(timing.rate(), limit),
                 _fmt_percent(percent_of_limit(timing, limit, limits), limit)]
        if timing.max_dy is not None:
            parts.append(f"max|dY| {timing.max_dy:.1e}")
        print(f"  {label:<{LABEL_WIDTH}} " + "  ".join(p for p in parts if p))
    sys.stdout.flush()


def print_summary(results, limits):
    """The table the issue notes quote: numkv beside its fastest peer, per case."""
    print("\nsummary: best peer = the fastest other implementation; ratio = its time / numkv's "
          "(below 1: the peer is faster); % = share of the machine limit (GEMM rate for prefill, "
          "read bandwidth for decode)")
    width = max([len(r.case.id) for r in results] + [4])
    print(f"  {'case':<{width}} {'numkv':>11} {'%':>5}  {'best peer':<42} {'time':>11} {'%':>5} {'ratio':>8}")
    for result in results:
        mine, best, limit = result.numkv(), result.best_peer(), result.case.limit
        cells = [f"  {result.case.id:<{width}}"]
        cells.append(_summary_time(mine) + _summary_percent(mine, limit, limits))
        if best is None:
            cells.append(f"  {'(no peer ran)':<42}")
        else:
            label = best.impl.label if len(best.impl.label) <= 42 else best.impl.label[:41] + "~"
            cells.append(f"  {label:<42}" + _summary_time(best) + _summary_percent(best, limit, limits))
            if mine is not None and mine.seconds:
                cells.append(f" {best.seconds / mine.seconds:7.2f}x")
        print("".join(cells))
    sys.stdout.flush()


def _summary_time(timing):
    return f" {fmt_time(timing.seconds)}" if timing is not None and timing.seconds is not None else f" {'-':>11}"


def _summary_percent(timing, limit, limits):
    percent = percent_of_limit(timing, limit, limits) if timing is not None else None
    return f" {percent:4.0f}%" if percent is not None else f" {'':>5}"


# -- the run -----------------------------------------------------------------------

def _have(module):
    return importlib.util.find_spec(module) is not None


def _set_threads(n):
    """Thread counts for every runtime: numkv's (``numkv.set_num_threads``);
    the BLAS libraries loaded (the GEMM limit, NumPy's matmuls) through threadpoolctl;
    onnxruntime's sessions take ``n`` when they are made."""
    if n is None:
        return nullcontext()
    if n < 1:
        raise SystemExit("--threads must be >= 1")
    numkv.set_num_threads(n)
    if _have("torch"):
        import torch

        torch.set_num_threads(n)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def machine_name():
    """The CPU model (from /proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions():
    parts = [f"numpy {np.__version__}", f"numba {runtime_info()[0]}"]
    for module in ("onnx", "onnxruntime", "torch"):
        if _have(module):
            parts.append(f"{module} {__import__(module).__version__}")
        else:
            parts.append(f"{module}: not installed")
    return ", ".join(parts)


def print_header(threads):
    print(f"numkv {numkv.__version__} bench on {machine_name()} ({platform.machine()}, {os.cpu_count()} CPUs), "
          f"Python {platform.python_version()}")
    print(f"  {versions()}")
    print(f"  numkv threads: {runtime_info()[1]}"
          + (f" (--threads {threads} for every runtime)" if threads else " (each runtime's default)"))


def measure_and_print_limits():
    from numkv._cli.bench_limits import measure_limits

    overwrite = "\r" if sys.stdout.isatty() else ""  # a terminal shows "measuring" until the figures come
    if overwrite:
        print("  machine limits: measuring ...", end="", flush=True)
    limits = measure_limits()
    print(f"{overwrite}  machine limits: {limits.describe()}", flush=True)
    return limits


def warm_up_kernels():
    """Compile (or load) the kernels the cases call before any is timed,
    saying so first when numba's cache is cold: the float32 attention
    kernel with the matrix products' tiles, the decode loops and the merge of
    a split key range; and the scatter kernel.  (Each other K/V format compiles its
    own loops on its case's first, untimed, call.)"""
    from numkv._cli.compile_notice import compile_notice

    with compile_notice("the benchmarked cases", seconds=8):
        q = np.ones((1, 32, 40, 16), np.float32)
        numkv.attention(q, q[:, :8], q[:, :8], is_causal=True)        # prefill: matrix products
        k = np.ones((1, 1, 3000, 16), np.float32)
        numkv.attention(q[:, :4, :1], k, k)                           # decode: loop, split, merge
        cache = np.zeros((2, 2, 8, 4), np.float32)
        numkv.tensor_scatter(cache, np.ones((2, 2, 1, 4), np.float32), [1, 2], out=cache)
