"""Where a cold first ``numkv.attention`` call's compile time goes.

    NUMBA_CACHE_DIR=$(mktemp -d) python tools/compile_profile.py                 # float32 decode
    NUMBA_CACHE_DIR=$(mktemp -d) NUMBA_OPT=1 python tools/compile_profile.py
    KV_DTYPE=bfloat16 NUMBA_CACHE_DIR=$(mktemp -d) python tools/compile_profile.py

Run it in a fresh process with an empty numba cache (else nothing compiles).
CPU time of the compiling thread (``time.thread_time``: robust to a shared
host's descheduling), exclusive of nested regions, per

* stage: numba's compiler passes (``numba:run_pass`` events: type inference,
  the other front-end passes, ``native_lowering`` = numba IR -> LLVM IR,
  the IR builders of the ``@intrinsic`` loops included) and LLVM's, timed by
  wrapping numba's ``CodeLibrary`` methods: per-function optimisation,
  module optimisation (O3, after linking the callees' modules in) and
  machine code (MCJIT), and the disk cache's save;
* compiled function (``numba:compile`` events, inclusive of the functions
  compiled while typing it).

The loops of each K/V format (``numkv._kernels.loop_functions``: C functions
compiled on demand) count too, as ``_compile.<locals>.scores`` and the like
(numkv fires the compile event for them).  Prints JSON; the figures of
2026-11-26 are in docs/compile-time.md.
"""

import json
import os
import time
from collections import defaultdict

import numpy as np
from numba.core import caching, codegen, event

_stack = []  # [label, start, time of nested regions]
_owners = []  # the functions being compiled, innermost last
exclusive = defaultdict(float)
by_function = defaultdict(float)
inclusive = defaultdict(float)


def _push(label):
    _stack.append([label, time.thread_time(), 0.0])


def _pop():
    label, start, nested = _stack.pop()
    spent = time.thread_time() - start
    if _stack:
        _stack[-1][2] += spent
    exclusive[label] += spent - nested
    by_function[(_owners[-1] if _owners else "-", label)] += spent - nested
    return spent


class _Compiles(event.Listener):
    def on_start(self, ev):
        fn = getattr(ev.data["dispatcher"], "py_func", None)
        _owners.append(fn.__qualname__ if fn else str(ev.data["dispatcher"]))
        _push("numba bookkeeping")

    def on_end(self, ev):
        inclusive[_owners[-1]] += _pop()
        _owners.pop()


class _Passes(event.Listener):
    def on_start(self, ev):
        _push("pass " + ev.data["name"].split(" [")[0])

    def on_end(self, ev):
        _pop()


def _timed(cls, name, label):
    original = getattr(cls, name)

    def timed(self, *args, **kwargs):
        _push(label)
        try:
            return original(self, *args, **kwargs)
        finally:
            _pop()

    setattr(cls, name, timed)


def main():
    event.register("numba:compile", _Compiles())
    event.register("numba:run_pass", _Passes())
    _timed(codegen.CPUCodeLibrary, "_optimize_functions", "llvm per-function optimisation")
    _timed(codegen.CPUCodeLibrary, "_optimize_final_module", "llvm module optimisation (O3, linked)")
    _timed(codegen.JITCodeLibrary, "_finalize_specific", "llvm machine code (MCJIT)")
    _timed(caching.Cache, "save_overload", "disk cache save")

    import numkv
    kv_dtype = os.environ.get("KV_DTYPE", "float32")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 1024, 64), dtype=np.float32) for _ in "kv")
    if kv_dtype != "float32":
        import ml_dtypes

        k, v = (a.astype(getattr(ml_dtypes, kv_dtype, None) or kv_dtype) for a in (k, v))
    start = time.thread_time()
    numkv.attention(q, k, v)
    first_call = time.thread_time() - start

    numkv.set_num_threads(1)  # what was compiled runs how fast (NUMBA_OPT matters)
    q = rng.standard_normal((1, 32, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in "kv")
    numkv.attention(q, k, v)
    samples = []
    for _ in range(31):
        start = time.thread_time()
        numkv.attention(q, k, v)
        samples.append(time.thread_time() - start)

    def rounded(items):
        return {key: round(value, 3) for key, value in sorted(items, key=lambda kv: -kv[1])}

    print(json.dumps({
        "first call, CPU s": round(first_call, 3),
        "compile CPU s by stage (exclusive)": rounded(exclusive.items()),
        "compile CPU s per compiled function (inclusive)": rounded(inclusive.items()),
        "CPU s per function and stage (>= 0.05)": rounded(
            ((f"{fn} | {label}", t) for (fn, label), t in by_function.items() if t >= 0.05)),
        "then: decode Skv=4096 D=64 float32, 1 thread, median CPU ms": round(1e3 * sorted(samples)[15], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
